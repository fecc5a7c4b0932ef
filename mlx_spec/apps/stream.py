"""Generator layers over the engine, in mlx-lm's shape:
rounds (token ids) → `stream_generate` (text pieces with stats) → `generate` (one result).

This is where text appears: prompts are tokenized, tokens detokenized, and stop strings
checked. Text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

from mlx_spec.core.cache.sequence import PromptCache
from mlx_spec.core.engine import Engine, Request, Round, in_company
from mlx_spec.core.policy import GammaPolicy
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.prompts import valid_text


@dataclass
class Response:
    text: str  # text new since the previous response (may be empty)
    round: Round  # the engine round behind it: tokens, γ, accepted
    stats: Stats  # live statistics (updated in place; `.snapshot()` to keep)
    finish_reason: Optional[str] = None  # "stop", "length" or None while generating
    from_draft: list[bool] = field(default_factory=list)  # per character of text
    tokens: list[int] = field(default_factory=list)  # the token ids whose text this releases
    stop_string: Optional[str] = None  # the stop string that ended generation, if one did

    def segments(self) -> list[tuple[str, bool]]:
        """`text` split into runs of (text, came from accepted draft tokens)."""
        runs: list[tuple[str, bool]] = []
        for ch, flag in zip(self.text, self.from_draft):
            if runs and runs[-1][1] == flag:
                runs[-1] = (runs[-1][0] + ch, flag)
            else:
                runs.append((ch, flag))
        return runs


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: Optional[str]
    prompt_tokens: int = 0
    rounds: list[Round] = field(default_factory=list, repr=False)


def encode_prompt(tokenizer, prompt: Union[str, Sequence[int]], chat: bool = False,
                  template_kwargs: Optional[dict] = None, images: int = 0) -> list[int]:
    """Token ids for `prompt`; with chat=True it is wrapped as one user turn in the
    tokenizer's chat template (given `template_kwargs`, such as enable_thinking), ending
    with the assistant's turn opener; `images` image parts lead the turn (the template
    writes each one's placeholder)."""
    if not isinstance(prompt, str):
        return list(prompt)
    prompt = valid_text(prompt)[0]  # lone surrogates (undecodable bytes) would break the tokenizer
    if chat:
        content = [{"type": "image"}] * images + [{"type": "text", "text": prompt}] if images else prompt
        messages = [{"role": "user", "content": content}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  **(template_kwargs or {})))
    return list(tokenizer.encode(prompt))


class _StopText:
    """Finds stop strings in streamed text; holds back a tail that may still grow into one.

    A flag per character (came from a draft token) travels with the text, and each token id
    is released together with the last character of its text, so the tokens released are
    exactly the text released: a stop string and what follows it are neither shown nor
    kept (a chat's next turn continues from what was shown).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.flags: list[bool] = []
        self.released = 0
        self.tokens: list[tuple[int, int]] = []  # unreleased (id, end of its text in self.text)
        self.textless: list[int] = []  # ids whose text has not appeared yet (partial UTF-8, EOS)
        self.dropped = 0  # tokens cut with a stop string
        self.matched: Optional[str] = None  # the stop string found

    def add(self, token: Optional[int], piece: str, flags: list[bool]) -> None:
        """Add a token (None: text alone, e.g. the detokenizer's final flush) and its text."""
        self.text += piece
        self.flags += flags
        if token is not None:
            self.textless.append(token)
        if piece:
            self.tokens += [(t, len(self.text)) for t in self.textless]
            self.textless = []

    def release(self, final: bool = False) -> tuple[str, list[bool], list[int], bool]:
        """(text safe to release, its flags, the tokens released with it, whether a stop
        string was found). `final`: generation ended, so nothing more is held back."""
        found = [(self.text.find(s, max(0, self.released - len(s))), s) for s in self.stops]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            cut, self.matched = min(found)
            self.text, self.flags = self.text[:cut], self.flags[:cut]
            out = self._release(cut)
            self.dropped = len(self.tokens) + len(self.textless)
            self.tokens, self.textless = [], []
            return (*out, True)
        if final:
            text, flags, tokens = self._release(len(self.text))
            tokens += self.textless
            self.textless = []
            return text, flags, tokens, False
        hold = max((_open_prefix(self.text, s) for s in self.stops), default=0)
        return (*self._release(max(self.released, len(self.text) - hold)), False)

    def _release(self, end: int) -> tuple[str, list[bool], list[int]]:
        text, flags = self.text[self.released : end], self.flags[self.released : end]
        self.released = end
        done = 0
        while done < len(self.tokens) and self.tokens[done][1] <= end:
            done += 1
        tokens = [t for t, _ in self.tokens[:done]]
        del self.tokens[:done]
        return text, flags, tokens


def _open_prefix(text: str, stop: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `stop` (text that
    may still grow into it). Only the last len(stop) - 1 characters can be one, and only
    where stop's first character occurs, so that is all this looks at."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i != -1:
        if stop.startswith(text[i:]):  # the first such start is the longest end
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0


class TextStream:
    """An answer's text as rounds commit its tokens: detokenized, stop strings found, and
    text that may still become one held back (`_StopText`). An answer made of several runs
    (a thought budget's, `mlx_spec.server.worker`) keeps one across them, so a stop string
    or a character that straddles two runs is found whole."""

    def __init__(self, tokenizer, stop: Sequence[str], eos_ids, skip_ids: frozenset = frozenset()):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stops = _StopText(stop)
        self.eos_ids = eos_ids
        # Tokens that are not text (vLLM's skip_special_tokens: special tokens by id, never
        # by their text, which the model may also spell out in plain tokens): the detokenizer
        # never sees them, so the text is that of the other tokens alone.
        self.skip_ids = skip_ids
        self.said = ""  # the text of every token added, none held back (`take_said` empties it)

    def add(self, tokens: Sequence[int], accepted: int = 0) -> None:
        """Committed tokens, the first `accepted` of them accepted drafts."""
        for i, t in enumerate(tokens):
            if t in self.eos_ids or t in self.skip_ids:  # no text; released with the next
                self.stops.add(t, "", [])
                continue
            self._add(t, t, i < accepted)

    def add_forced(self, tokens: Sequence[int]) -> None:
        """Tokens the caller put into the answer (a thought's forced end marker): their text
        joins the answer's, but no released id stands for them."""
        for t in tokens:
            self._add(t, None, False)

    def _add(self, token: int, released: Optional[int], from_draft: bool) -> None:
        self.detokenizer.add_token(token)
        piece = self.detokenizer.last_segment
        self.said += piece
        self.stops.add(released, piece, [from_draft] * len(piece))

    def finish(self) -> None:
        """The answer ended: the detokenizer's last text."""
        self.detokenizer.finalize()
        piece = self.detokenizer.last_segment  # a property that consumes the segment
        self.said += piece
        self.stops.add(None, piece, [False] * len(piece))

    def take_said(self) -> str:
        said, self.said = self.said, ""
        return said


def stream_generate(
    engine: Engine,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    params: SamplingParams = SamplingParams(),
    *,
    gamma: "int | GammaPolicy" = 3,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    chat: bool = False,
    prompt_cache: Optional[PromptCache] = None,
    stats: Optional[Stats] = None,
    prefill_progress=None,
    logprobs: Optional[int] = None,
    images=None,
    constraint=None,
    batched: bool = False,
    alone=None,
) -> Iterator[Response]:
    """Stream text from `prompt`, one `Response` per engine round.

    Args:
        engine: the `Engine` (target, drafter).
        tokenizer: an mlx-lm `TokenizerWrapper` (its detokenizer streams text).
        prompt: text, or token ids used as they are.
        params, gamma, max_tokens, prompt_cache, prefill_progress, logprobs, images, constraint,
            batched, alone: as `Engine.rounds` (constraint: a fresh `mlx_spec.core.grammar.Matcher`
            per generation; with `batched` what it yields for the batch is yielded as it comes).
        stop: strings that end generation; the text returned stops before them.
        chat: wrap a text prompt in the chat template as one user turn.
    Yields:
        `Response`s; the last one has a finish_reason.
    """
    request = Request(encode_prompt(tokenizer, prompt, chat), params, gamma, max_tokens, logprobs, images, constraint)
    yield from stream_request(engine, tokenizer, request, stop=stop, prompt_cache=prompt_cache, stats=stats,
                              prefill_progress=prefill_progress, company=in_company(params, batched, alone))


def stream_request(engine: Engine, tokenizer, request: Request, *, stop: Sequence[str] = (),
                   prompt_cache: Optional[PromptCache] = None, stats: Optional[Stats] = None,
                   prefill_progress=None, company=None, text: Optional[TextStream] = None) -> Iterator[Response]:
    """`stream_generate` for a `Request` already in token ids (`company`: as `Engine.run`).
    `text`: the answer's `TextStream` to continue (then `stop` is its own), or None for a
    fresh one."""
    stats = stats if stats is not None else Stats()
    text = text if text is not None else TextStream(tokenizer, stop, engine.eos_ids)
    stops = text.stops
    rounds = engine.run(request, prompt_cache=prompt_cache, stats=stats, prefill_progress=prefill_progress,
                        company=company)
    for rnd in rounds:
        if not isinstance(rnd, Round):  # for the batch: a pass, PREFILLING or RAN_ALONE
            yield rnd
            continue
        # accepted draft tokens lead the round: token i came from the draft iff i < n
        text.add(rnd.tokens, rnd.accepted)
        if rnd.finish_reason:
            text.finish()
        released, text_flags, tokens, stopped = stops.release(final=rnd.finish_reason is not None)
        if stopped:
            stats.retract(stops.dropped)
        finish = "stop" if stopped else rnd.finish_reason
        yield Response(released, rnd, stats, finish, text_flags, tokens, stops.matched if stopped else None)
        if finish:
            rounds.close()
            return


def generate(
    engine: Engine,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    params: SamplingParams = SamplingParams(),
    **kwargs,
) -> Result:
    """Generate to completion; arguments as `stream_generate`. Returns a `Result`."""
    text, tokens, rounds, finish, stats = [], [], [], None, None
    for response in stream_generate(engine, tokenizer, prompt, params, **kwargs):
        text.append(response.text)
        tokens.extend(response.tokens)
        rounds.append(response.round)
        finish, stats = response.finish_reason, response.stats
    return Result("".join(text), tokens, stats, finish, stats.prompt_tokens if stats else 0, rounds)
