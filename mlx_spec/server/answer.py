"""One job's answer as the worker streams it: its text (`stream.TextStream`, one across the
runs a thought budget makes, so stop strings and characters straddling them are found
whole), split into thought and answer, the log-probs released with the text, and the
rounds' drafting counted apart for thought and answer (`thinking.PhaseAcceptance`)."""

from __future__ import annotations

from typing import Optional, Sequence

from mlx_spec.apps.stream import Response, TextStream
from mlx_spec.apps.thinking import PhaseAcceptance, ThoughtSplitter
from mlx_spec.core.stats import Stats
from mlx_spec.server.jobs import Job, Piece


class Answer:
    """Args: job: the job answered; tokenizer: its detokenizer streams the text; eos_ids:
    the ids that end an answer (no text)."""

    def __init__(self, job: Job, tokenizer, eos_ids):
        self.text = TextStream(tokenizer, job.stop, eos_ids, job.skip_ids)
        self.splitter = ThoughtSplitter(job.think, job.thinking)  # the released text's
        # Every committed token's text, none held back by a stop string: which part a round
        # began in, as the model wrote it (a round that crosses a marker counts for the first).
        self.phase = ThoughtSplitter(job.think, job.thinking)
        self.phases = PhaseAcceptance()
        self.thought_seen = self.splitter.thinking
        self.scored: list = []  # (id, log-prob, alternatives) of committed tokens not yet released
        self.released = 0  # ids released with text (usage counts them)
        self._counted = (0, 0)  # the stats' drafted and accepted at the last round

    @property
    def thought_closed(self) -> bool:
        """A thought was written and has ended."""
        return self.thought_seen and not self.splitter.thinking

    def round(self, response: Response) -> Optional[Piece]:
        """A round streamed: its drafting counted for the part it began in (as the stats
        count it: the drafter's tokens, not a grammar's forced ones), its text released."""
        stats = response.stats
        self.phases.observe(self.phase.thinking, stats.drafted - self._counted[0], stats.accepted - self._counted[1])
        self._counted = (stats.drafted, stats.accepted)
        self.phase.feed(self.text.take_said())
        rnd = response.round
        if rnd.logprobs is not None:
            self.scored += [(t, *lp) for t, lp in zip(rnd.tokens, rnd.logprobs)]
        return self._release(response.text, response.tokens)

    def force(self, tokens: Sequence[int], stats: Stats) -> tuple[Optional[Piece], Optional[str]]:
        """Tokens put into the answer, not generated (a thought's end marker): their text
        joins the answer's. Returns (the piece released, the stop string found or None)."""
        self.text.add_forced(tokens)
        self.phase.feed(self.text.take_said())
        return self._released(final=False, stats=stats)

    def end(self, stats: Stats) -> tuple[Optional[Piece], Optional[str]]:
        """The answer ends without another round (after forced tokens): the rest of its text."""
        self.text.finish()
        return self._released(final=True, stats=stats)

    def close(self) -> Optional[Piece]:
        """What the splitter still holds, once the answer is over."""
        reasoning, text = self.splitter.finish()
        return Piece(text, [], reasoning) if reasoning or text else None

    def _released(self, final: bool, stats: Stats) -> tuple[Optional[Piece], Optional[str]]:
        stops = self.text.stops
        text, _, ids, stopped = stops.release(final=final)
        if stopped:
            stats.retract(stops.dropped)
        return self._release(text, ids), stops.matched if stopped else None

    def _release(self, text: str, ids: list[int]) -> Optional[Piece]:
        # An EOS is released too: counted in usage, it has its log-prob entry.
        released, self.scored = self.scored[: len(ids)], self.scored[len(ids):]
        self.released += len(ids)
        reasoning, answer = self.splitter.feed(text)
        self.thought_seen = self.thought_seen or self.splitter.thinking or bool(reasoning)
        return Piece(answer, released, reasoning) if answer or reasoning or released else None
