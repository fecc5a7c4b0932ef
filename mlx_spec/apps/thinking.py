"""Thinking: the thought a model writes before its answer, split from the answer as it streams.

A model that thinks writes its thought between two markers that its tokenizer names (mlx-lm's
`TokenizerWrapper` infers them from the vocabulary: Gemma 4's `<|channel>thought` ...
`<channel|>`, Qwen's `<think>` ... `</think>`), and the chat template switches it with
`enable_thinking` (Gemma 4's puts `<|think|>` into the system turn when it is on, and an
empty `<|channel>thought\\n<channel|>` after the model's opener when it is off). The text
between the markers is the thought (`reasoning_content`, Anthropic's `thinking` block); the
markers themselves are neither. Earlier turns' thoughts are the template's business:
Gemma 4's drops them from history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ThinkSyntax:
    """How the model writes a thought: its start and end markers."""

    start: str
    end: str


def think_syntax(tokenizer) -> Optional[ThinkSyntax]:
    """The tokenizer's thought markers, or None when its model does not think."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if not getattr(tokenizer, "has_thinking", False) or not start or not end:
        return None
    return ThinkSyntax(start, end)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ThoughtSplitter:
    """Splits streamed text into (thought, answer) pieces.

    Text that could still be the start of the marker it waits for is held back until it
    cannot, so a marker split over tokens (or rounds) is found whole. The newline that
    follows a start marker (Gemma 4's `<|channel>thought\\n`) is the markup's, not the
    thought's. Thoughts after the first are thoughts too (a model may think again after a
    tool call).

    Args:
        syntax: the markers; None: everything is answer.
        thinking: the prompt ended inside a thought (a template that opens it, as Qwen's
            `<think>\\n`), so the text starts as thought.
    """

    def __init__(self, syntax: Optional[ThinkSyntax], thinking: bool = False):
        self.syntax = syntax
        self.thinking = thinking and syntax is not None
        self.buffer = ""
        self._fresh = self.thinking  # at a thought's start: its leading newline is markup

    def feed(self, text: str) -> tuple[str, str]:
        """(thought text, answer text) released by `text`, in order within each."""
        if self.syntax is None:
            return "", text
        self.buffer += text
        thought, answer = [], []
        while self.buffer:
            if self._fresh:
                self.buffer = self.buffer.lstrip("\n")
                if not self.buffer:
                    break
                self._fresh = False
            marker = self.syntax.end if self.thinking else self.syntax.start
            at = self.buffer.find(marker)
            out = thought if self.thinking else answer
            if at < 0:
                keep = partial_suffix(self.buffer, marker)
                out.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            out.append(self.buffer[:at])
            self.buffer = self.buffer[at + len(marker):]
            self.thinking = not self.thinking
            self._fresh = self.thinking
        return "".join(thought), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is held back when the text ends (an unfinished marker is text)."""
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.thinking else ("", rest)


def opens_thought(tokenizer, syntax: Optional[ThinkSyntax], prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a thought (its template opened one for the model)."""
    if syntax is None or not prompt_ids:
        return False
    tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False).rstrip()
    return tail.endswith(syntax.start)


@dataclass
class PhaseAcceptance:
    """Drafted and accepted tokens of the rounds that began inside a thought and of the
    others, apart: a drafter guesses reasoning and answers unequally well. A round that
    crosses a marker counts for the part it began in."""

    thought: list[int] = field(default_factory=lambda: [0, 0])
    answer: list[int] = field(default_factory=lambda: [0, 0])

    def observe(self, thinking: bool, drafted: int, accepted: int) -> None:
        phase = self.thought if thinking else self.answer
        phase[0] += drafted
        phase[1] += accepted

    def as_dict(self) -> dict:
        """`thought_acceptance` and `answer_acceptance`: drafted, accepted, acceptance_rate."""
        return {f"{name}_acceptance": {"drafted": d, "accepted": a, "acceptance_rate": a / d if d else 0.0}
                for name, (d, a) in (("thought", self.thought), ("answer", self.answer))}
