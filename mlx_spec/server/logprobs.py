"""Log-probs in OpenAI's shapes: each token labelled and its bytes followed through the
answer's text (`token_describer`, `AnswerBytes`), chat's `{"content": [...]}` or the
completions API's parallel lists (`logprobs_object`)."""

from __future__ import annotations

import codecs
import functools
from typing import Callable

from mlx_spec.loading.fast_tokenizer import token_bytes_reader


def token_describer(tokenizer, eos_ids) -> Callable[[int], tuple[str, bytes]]:
    """id -> (its label, the bytes it adds to the answer's text) for log-probs, cached.

    A label names one token: its text, or where its bytes are not whole UTF-8 alone (or it
    is a byte-fallback token, which would share an ASCII piece's text) "bytes:" and the
    bytes, escaped, as OpenAI's own completions API writes them ("bytes:\\xe2\\x80"); an id
    past the vocabulary is "token_id:N", as vLLM writes ids. So byte tokens of split
    characters no longer share the label U+FFFD, and joining every token's bytes gives the
    answer's text. An EOS id is labelled by its piece and adds no text."""
    read = token_bytes_reader(tokenizer)

    @functools.lru_cache(maxsize=1 << 16)
    def describe(token: int) -> tuple[str, bytes]:
        data, kind = read(token)
        if kind == "missing":
            label = f"token_id:{token}"
        else:
            try:
                label = data.decode("utf-8") if kind == "piece" else None
            except UnicodeDecodeError:
                label = None
            if label is None:
                label = "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}"
                                           for b in data)
        return label, b"" if token in eos_ids else data

    return describe


class AnswerBytes:
    """What each token of one answer adds to its text, followed across a stream's chunks:
    the token's bytes, less the space the answer starts with where the detokenizer drops it
    (`trims_first_space`), and the characters of text before it (completions'
    `text_offset`). Bytes go through an incremental UTF-8 decoder, so a character split
    over byte tokens counts once, and each of its tokens is at its start."""

    def __init__(self, trims_first_space: bool = False, skipped: frozenset = frozenset()):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._trim = trims_first_space
        self.skipped = skipped  # tokens left out of the text (`Job.skip_ids`): they add no bytes
        self.chars = 0

    def add(self, data: bytes) -> tuple[int, bytes]:
        """(the offset of a token adding `data`, the bytes it shows); moves past it."""
        if self._trim and data:
            self._trim, data = False, data[1:] if data.startswith(b" ") else data
        at, pending = self.chars, self._decoder.getstate()[0]
        if pending and data:  # a character cut short before this token is one U+FFFD
            probe = codecs.getincrementaldecoder("utf-8")("replace")
            at += probe.decode(pending + data[:1]).startswith("\ufffd")
        self.chars += len(self._decoder.decode(data))
        return at, data


def logprobs_object(chat: bool, scored: list, describe, answer: AnswerBytes) -> dict:
    """Log-probs of answer tokens in OpenAI's shape: chat's `{"content": [...]}` or the
    completions API's parallel lists. `scored`: (id, log-prob, [(id, log-prob)...]) per
    token, an EOS included (usage counts it); `describe`: `token_describer`'s; `answer`:
    the answer's `AnswerBytes` so far (a stream's), advanced in place."""
    labels, shown, offsets = [], [], []
    for t, _, _ in scored:
        label, data = describe(t)
        at, data = answer.add(b"" if t in answer.skipped else data)
        labels.append(label)
        shown.append(data)
        offsets.append(at)
    if chat:
        def entry(t, lp):
            label, data = describe(t)
            return {"token": label, "logprob": lp, "bytes": list(data)}
        return {"content": [{"token": label, "logprob": lp, "bytes": list(data),
                             "top_logprobs": [entry(a, b) for a, b in top]}
                            for label, data, (_, lp, top) in zip(labels, shown, scored)]}
    return {"tokens": labels, "token_logprobs": [lp for _, lp, _ in scored],
            "top_logprobs": [_top_by_label(t, lp, top, describe) for t, lp, top in scored],
            "text_offset": offsets}


def _top_by_label(chosen: int, logprob: float, top: list, describe) -> dict:
    """Completions' top log-probs, keyed by label, likeliest first, with the chosen token
    under its own label (as OpenAI's: "up to logprobs + 1" entries). Labels name tokens;
    should two still meet, the less likely one is keyed "token_id:N"."""
    taken, pairs = {describe(chosen)[0]}, []
    for token, p in top:
        label = describe(token)[0]
        if token != chosen and label in taken:
            label = f"token_id:{token}"
        taken.add(label)
        pairs.append((label, p))
    if all(token != chosen for token, _ in top):
        pairs.append((describe(chosen)[0], logprob))
    return dict(pairs)
