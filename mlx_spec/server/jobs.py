"""A job: one request's generation as the worker takes it (`Job`), the events it sends back
to the request's coroutine (`Piece`, then `Done` or `Failed`), and the worker's refusals
(`Busy`, `ShuttingDown`)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Optional, Union

from mlx_spec.apps.thinking import PhaseAcceptance, ThinkSyntax
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.models.vision import ImagePrompt


@dataclass
class Piece:
    text: str  # new answer text (may be empty)
    # with Job.logprobs: (token id, log-prob, top alternatives) per token released with text
    logprobs: list = field(default_factory=list)
    reasoning: str = ""  # new thought text (`thinking.ThoughtSplitter`), markers left out
    # with Job.score_prompt: the prompt's own log-probs, in `logprobs`' form (`prompt_scores`)
    prompt_logprobs: Optional[list] = None


@dataclass
class Done:
    finish_reason: Optional[str]  # "stop", "length", or None when cancelled
    completion_tokens: int
    prefilled_target: int  # prompt tokens the target processed (the rest came from its cache)
    stats: Stats
    stop_string: Optional[str] = None  # the stop string that ended the answer, if one did
    phases: PhaseAcceptance = field(default_factory=PhaseAcceptance)  # thought and answer apart
    load_seconds: Optional[float] = None  # set when this job first loaded the models (keep-alive)
    batch_size: int = 1  # the most requests decoded in one forward with this one (itself included)


@dataclass
class Failed:
    status: int
    message: str


Event = Union[Piece, Done, Failed]


@dataclass(eq=False)  # a job is itself: the worker keys its running jobs by it
class Job:
    """One request's work, and the channel its events travel back on."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    logprobs: Optional[int] = None  # top alternatives per token; None: no log-probs
    # Prompt tokens read from the prompt cache: set by the worker before its first Piece or
    # Done (a stream's first event can report the prompt's usage whole, as Anthropic's does).
    cached_tokens: Optional[int] = None
    think: Optional[ThinkSyntax] = None  # the model's thought markers: thoughts split out
    thinking: bool = False  # the prompt ends inside a thought
    thought_budget: Optional[int] = None  # thought tokens before the end marker is forced
    keep_alive: Optional[float] = None  # idle seconds after this job before unloading (None: the server's)
    images: Optional[ImagePrompt] = None  # the prompt's images (its ids are prompt_ids)
    grammar: Optional[object] = None  # a compiled `mlx_spec.core.grammar.Grammar` the answer follows
    batch_size: int = 1  # the most requests decoded in one forward with this one (set by the worker)
    tenant: Optional[str] = None  # its API key's digest (`guards.tenant`); None without keys
    score_prompt: bool = False  # send the prompt's log-probs first (completions' echo with logprobs)
    skip_ids: frozenset = frozenset()  # special tokens left out of the text (`skip_special_tokens`)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, event: Event) -> None:
        """Hand an event to the request's coroutine (called from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            self.cancelled.set()


class Busy(Exception):
    """The queue is full; `retry_after` estimates when a place frees up (seconds)."""

    def __init__(self, retry_after: int):
        super().__init__(f"busy, retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server is stopping and takes no more requests."""


SHUTTING_DOWN = Failed(503, "the server is shutting down")


def cached_count(job: Job, prefilled_target: int) -> int:
    """Prompt tokens the target's cache held: it prefills all but the prompt's last token
    (the first verify pass feeds it)."""
    return max(0, len(job.prompt_ids) - 1 - prefilled_target)
