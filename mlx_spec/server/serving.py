"""What every API's routes share, after vLLM's `OpenAIServing`: a `Serving` base class over
one `ServingContext` (the options, the generation `worker`, the `ServedModel`'s tokenizer
facts, the tokenizer and parsing threads), which each API subclasses with its routes
(`serving_openai`, `serving_anthropic`, `serving_responses`).

A request goes through the same steps in every API. Its body is parsed, checked and turned
into template messages on the parsing thread (a 16 MiB body is up to a second of CPU work):
`parsed`, with `validate` computing once, before any tokens, everything a generation needs
from the body (`CheckedRequest`: the model's name, sampling values, stop strings,
log-probs, keep-alive; then its tool plan and grammar). Its prompt is tokenized on the
tokenizer thread (so a big prompt does not stall other clients, and before queueing, so
errors such as a prompt over the context are answered at once): `chat_ids`. A full queue is
a 503 with Retry-After, checked before tokenizing: a prompt being tokenized holds its place
in the queue, and count_tokens' prompts wait for the tokenizer only while fewer than
`queue_size` do, so a burst of big prompts cannot line up more tokenizer work than the
queue takes (`TokenizerThread`). Then `submit` hands a `Job` to the worker, and the route
relays its events (`collect` for a whole answer). A client that goes away cancels its job.
Handlers run on the event loop and never touch MLX.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, ClassVar, Optional

from fastapi import FastAPI, Request

from mlx_spec.apps.thinking import ThinkSyntax, opens_thought, think_syntax
from mlx_spec.core.grammar import Grammar, compile_grammar, llg_tokenizer
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.errors import UsageError
from mlx_spec.loading.fast_tokenizer import trims_first_space
from mlx_spec.models.vision import ImageError, ImagePrompt, ImagePrompter
from mlx_spec.server.api_error import ApiError
from mlx_spec.server.chat_prompt import ChatPrompts
from mlx_spec.server.images import content_texts, has_images, take_images
from mlx_spec.server.jobs import SHUTTING_DOWN, Busy, Done, Failed, Job, Piece, ShuttingDown, cached_count
from mlx_spec.server.logprobs import token_describer
from mlx_spec.server.options import ServerOptions
from mlx_spec.server.request_base import RequestBody
from mlx_spec.server.call_grammars import QUOTE
from mlx_spec.server.tools import CallSplitter, ToolPlan, ToolSyntax, tool_syntax
from mlx_spec.server.worker import Worker, keep_alive_seconds

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks for its client
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # a streamed answer's


@dataclass(frozen=True)
class ServedModel:
    """What the routes know of the served model, worked out once from its tokenizer. The
    engine itself is not kept: a keep-alive unload must find its weights unreferenced."""

    tokenizer: object  # mlx-lm's TokenizerWrapper (shared with the worker, never between requests)
    eos_ids: object
    vocab_size: int  # ids the detokenizer knows
    longest_token: int  # bytes of the longest vocabulary entry (`Serving.check_length`)
    tool_syntax: Optional[ToolSyntax]  # how it writes a call; None: it cannot
    think: Optional[ThinkSyntax]  # its thought markers; None: it does not think
    describe: Callable  # log-prob labels (`logprobs.token_describer`)
    trims_first_space: bool  # the detokenizer drops the answer's first space
    prompts: ChatPrompts
    prompter: Optional[ImagePrompter]  # the processor needs no weights: it stays through an unload
    drafter: str  # the drafter's name, "none" without one

    @cached_property  # ControlTokens loads transformers' tokenizer behind a FastTokenizer: at first use
    def skipped_ids(self) -> frozenset:
        """The special tokens left out of answers' text (`skip_special_tokens`): every one but
        the markers the answer is parsed by afterwards (`markers`)."""
        kept = {t for marker in self.markers for t in self.tokenizer.encode(marker, add_special_tokens=False)}
        return frozenset(self.prompts.controls.ids.values()) - kept

    @cached_property
    def markers(self) -> tuple[str, ...]:
        """The texts the parsers read the answer by: the call markers (and Gemma 4's string
        delimiter) and the thought markers. They read them as text, as they always have."""
        markers = [self.tool_syntax.start, self.tool_syntax.end] if self.tool_syntax else []
        if self.tool_syntax is not None and self.tool_syntax.grammar_format == "gemma4":
            markers.append(QUOTE)
        if self.think is not None:
            markers += [self.think.start, self.think.end]
        return tuple(m for m in markers if m)

    @classmethod
    def of(cls, engine, tokenizer, parse_special_in_text: bool) -> ServedModel:
        vocab = tokenizer.get_vocab()
        return cls(
            tokenizer, engine.eos_ids, len(vocab),
            # No token's text is longer than its vocabulary entry in UTF-8 (byte-level and
            # SentencePiece entries spell a byte or space with one or more bytes).
            max(len(piece.encode("utf-8")) for piece in vocab),
            tool_syntax(tokenizer), think_syntax(tokenizer), token_describer(tokenizer, engine.eos_ids),
            trims_first_space(tokenizer), ChatPrompts(tokenizer, parse_special=parse_special_in_text),
            engine.vision.prompter if engine.vision is not None else None,
            engine.drafter.name if engine.drafter is not None else "none")


def busy(why: str, retry_after: int) -> ApiError:
    return ApiError(503, f"the server is busy ({why}); retry later", type="server_error",
                    code="server_busy", headers={"Retry-After": str(retry_after)})


def refusal(error: Exception, queue_size: int) -> ApiError:
    """The 503 for the worker's `Busy` or `ShuttingDown`."""
    if isinstance(error, ShuttingDown):
        return ApiError(503, SHUTTING_DOWN.message, type="server_error", code="shutting_down")
    return busy(f"{queue_size} requests waiting", error.retry_after)


class TokenizerThread:
    """The one thread that tokenizes prompts (the tokenizer is not shared between request
    threads, only with the worker), with its backlog kept bounded: the executor's own
    queue has none. A second one compiles grammars (`Serving.compiled`), so a costly
    schema never holds the parsing thread, which every request passes through."""

    def __init__(self, worker: Worker, queue_size: int, name: str = "tokenize"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mlx-spec-{name}")
        self._worker, self._queue_size = worker, queue_size
        # Prompts on or waiting for the thread, and how many of them are for the queue
        # (changed on the event loop only).
        self.now = self.queued = 0

    async def run(self, function, *args, queued: bool = True):
        """`function(*args)` on the thread, or a 503 first. A prompt for the queue (`queued`)
        holds its place there from now on: refused if the queue, with the prompts tokenizing
        for it, is full. Another (count_tokens') is refused once `queue_size` prompts are
        tokenizing."""
        if queued:
            try:
                self._worker.check_room(coming=self.queued)
            except (Busy, ShuttingDown) as error:
                raise refusal(error, self._queue_size) from None
        elif self.now >= self._queue_size:
            raise busy(f"{self.now} prompts being tokenized", retry_after=1)
        self.now, self.queued = self.now + 1, self.queued + queued
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)
        finally:
            self.now, self.queued = self.now - 1, self.queued - queued

    def warm(self, function, *args) -> None:
        """Run `function(*args)` on the thread now, ahead of any request (counted nowhere)."""
        self._executor.submit(function, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class ServingContext:
    """What every API's serving object shares, built once by `create_app`; it starts and
    stops with the app."""

    options: ServerOptions
    worker: Worker
    model: ServedModel
    tokenizing: TokenizerThread
    parsing: ThreadPoolExecutor  # reads bodies (`Serving.parsed`)
    compiling: TokenizerThread  # compiles grammars (`Serving.compiled`)
    imaging: TokenizerThread  # reads, decodes and processes images (`Serving.chat_ids`)

    @classmethod
    def of(cls, engine, tokenizer, options: ServerOptions, load=None) -> ServingContext:
        worker = Worker(engine, tokenizer, options.gamma, options.queue_size, options.cache_budget,
                        load=load, keep_alive=options.keep_alive, cache_dir=options.prompt_cache_dir,
                        cache_disk=options.prompt_cache_disk, parallel=options.parallel,
                        draft_memory=options.draft_memory, draft_memory_tokens=options.draft_memory_tokens)
        # One parsing thread: parsing holds the GIL for most of its work, so more would not be
        # faster, only hold more parsed bodies at once.
        parsing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-spec-parse")
        return cls(options, worker, ServedModel.of(engine, tokenizer, options.parse_special_in_text),
                   TokenizerThread(worker, options.queue_size), parsing,
                   TokenizerThread(worker, options.queue_size, name="compile"),
                   TokenizerThread(worker, options.queue_size, name="images"))

    def start(self) -> None:
        self.worker.start()
        # llguidance's view of the tokenizer takes seconds to build (Gemma's 262k ids): built
        # now, on the compiling thread, rather than by the first structured request.
        self.compiling.warm(llg_tokenizer, self.model.tokenizer, self.model.eos_ids)

    def stop(self) -> None:
        self.worker.stop()
        self.tokenizing.shutdown()
        self.compiling.shutdown()
        self.imaging.shutdown()
        self.parsing.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class CheckedRequest:
    """A generation request as `Serving.validate` checked it, before any tokens: what
    `Serving.submit` needs from the body, each value computed once."""

    body: RequestBody  # as sent (stream, stream_options, thinking, ...)
    sampling: SamplingParams  # the request's values over the server's defaults
    stops: tuple[str, ...]
    logprobs: Optional[int]  # top alternatives per token; None: no log-probs
    keep_alive: Optional[float]  # idle seconds after it before unloading; None: the server's
    max_tokens: Optional[int]  # as asked; `completion_budget` fits it to the prompt
    plan: ToolPlan = field(default_factory=ToolPlan)  # what its tools make of prompt and answer
    wanted: Optional[WantedGrammar] = None  # the grammar its answer must follow, to compile
    grammar: Optional[Grammar] = None  # that grammar compiled (`Serving.compiled`)


@dataclass(frozen=True)
class WantedGrammar:
    """A grammar a request asks for, before it is compiled, and the field that asked."""

    kind: str
    source: object
    param: str
    fallback: Optional[str] = None  # a Lark grammar to take if `source` cannot compile (`ToolPlan.fallback`)


@dataclass(frozen=True)
class Conversation:
    """A chat request's messages as its chat template takes them, and how to render them
    (`prompt.ChatPrompts.ids`)."""

    messages: list[dict]
    continue_final: bool = False  # the answer continues the final assistant message
    generation_prompt: bool = True  # the prompt opens the model's turn
    template_kwargs: dict = field(default_factory=dict)


class Serving:
    """The base of each API's serving object: the steps every route takes (read and check
    the body, tokenize its prompt, queue its generation, collect its answer) over the shared
    `ServingContext`. A subclass mounts its routes in `add_routes`; `error_bodies` maps the
    paths (and what lies under them) whose errors take its API's shape, not OpenAI's."""

    error_bodies: ClassVar[dict] = {}

    def __init__(self, context: ServingContext):
        self.options, self.worker, self.model = context.options, context.worker, context.model
        self.tokenizing, self.parsing, self.compiling = context.tokenizing, context.parsing, context.compiling
        self.imaging = context.imaging

    def add_routes(self, app: FastAPI) -> None:
        raise NotImplementedError

    # -- the body (on the parsing thread) --------------------------------------------------

    async def parsed(self, request: Request, read, *args):
        """`read(the request's body, *args)` on the parsing thread: parsing, checks and
        templating, none of which may hold the event loop."""
        raw = await request.body()
        return await asyncio.get_running_loop().run_in_executor(self.parsing, read, raw, *args)

    def check_model(self, body: RequestBody) -> None:
        """Any name is answered by the one served model, under its served name (as LM Studio
        and Ollama's agent launchers do: Claude Code names Anthropic's models, opencode its
        configured id); `strict_model_names` refuses other names with a 404."""
        if (self.options.strict_model_names and body.model != self.options.model_name
                and body.model not in self.options.aliases):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.options.model_name!r}", param="model", code="model_not_found")

    def validate(self, body: RequestBody) -> CheckedRequest:
        """The checks a generation needs that need no tokens, so a wrong request gets its 400
        before any 503 and any tokenizing: the model's name, its sampling values, stop
        strings, log-probs and keep-alive, in that order, kept for `submit`."""
        self.check_model(body)
        sampling = body.sampling(self.options.defaults)
        stops = body.stops()
        logprobs = body.logprob_count()
        keep_alive = None
        if body.keep_alive is not None:
            try:
                keep_alive = keep_alive_seconds(body.keep_alive)
            except ValueError as error:
                raise ApiError(400, f"keep_alive: {error}", param="keep_alive",
                               code="invalid_value") from None
        return CheckedRequest(body, sampling, stops, logprobs, keep_alive, body.requested_tokens())

    def output_grammar(self, body: RequestBody, plan: ToolPlan = ToolPlan(),
                       template_kwargs: Optional[dict] = None) -> Optional[WantedGrammar]:
        """The grammar the answer must follow (compiled later, off this thread: `compiled`):
        a forced call's (`tools.forced_grammar`), else the body's output format,
        else None. An output format with thinking on (`template_kwargs`' enable_thinking) is a
        400: it would hold from the first token, so the thought would be forced into the
        answer's shape or not be written. A forced call's is not: its prompt ends with the
        call's start marker, so no thought comes before the call either way."""
        if plan.grammar is not None:
            return WantedGrammar("lark", plan.grammar, "tools", plan.fallback)
        output = body.output_format()
        if output is None:
            return None
        wanted = WantedGrammar(*output, body.FORMAT_PARAM)
        if (template_kwargs or {}).get("enable_thinking"):
            raise ApiError(400, f"{wanted.param}: structured output cannot be combined with thinking yet (the "
                                "grammar would hold from the first token, the thought's); turn thinking off",
                           param=wanted.param, code="thinking_with_structured_output")
        return wanted

    async def compiled(self, checked: CheckedRequest) -> CheckedRequest:
        """`checked` with its wanted grammar compiled, on the compiling thread (a 503 when
        the queue, or that thread's backlog, is full). One that cannot compile is a 400
        naming the field that asked for it."""
        wanted = checked.wanted
        if wanted is None:
            return checked
        try:
            grammar = await self.compiling.run(compile_grammar, self.model.tokenizer, wanted.kind, wanted.source,
                                               self.model.eos_ids)
        except UsageError as error:
            if wanted.fallback is None:
                raise ApiError(400, f"{wanted.param}: {error}", param=wanted.param, code="invalid_value") from None
            # a forced call that is not strict is still a call, its arguments any object
            grammar = await self.compiling.run(compile_grammar, self.model.tokenizer, "lark", wanted.fallback,
                                               self.model.eos_ids)
        return replace(checked, grammar=grammar)

    # -- the prompt (on the tokenizer thread) ---------------------------------------------

    async def chat_ids(self, conversation: Conversation, plan: ToolPlan,
                       queued: bool = True) -> tuple[list[int], Optional[ImagePrompt]]:
        """The conversation's prompt ids (`ChatPrompts.ids`) and, if it has images, its
        `ImagePrompt` (whose ids they are), made off the event loop once its text could fit
        the context (and, `queued`, once the queue has room: `TokenizerThread.run`). Images
        are read, decoded and processed on a thread of their own, so a request's images never
        hold another request's tokenizing."""
        self.check_length(sum(len(text) for m in conversation.messages
                              for text in content_texts(m["content"])), "messages")
        messages, images = conversation.messages, []
        if has_images(messages):
            messages, images = await self.imaging.run(
                take_images, messages, self.model.prompter, self.options.allow_image_urls,
                self.options.allow_image_files, self.options.context_length, self.options.allow_private_image_urls,
                queued=queued)
        ids = await self.tokenizing.run(self.model.prompts.ids, messages, plan, conversation.continue_final,
                                        conversation.generation_prompt, conversation.template_kwargs, queued=queued)
        if not images:
            return ids, None
        image_prompt = await self.imaging.run(self._image_prompt, ids, images, queued=queued)
        return image_prompt.ids, image_prompt

    def _image_prompt(self, ids: list[int], images: list) -> ImagePrompt:
        try:
            return self.model.prompter.prompt(ids, images)
        except ImageError as error:
            raise ApiError(400, f"messages: {error}", param="messages") from None

    def check_length(self, characters: int, param: str) -> None:
        """Refuse, before templating or tokenizing it, text that cannot fit the context:
        it needs at least characters / longest_token tokens."""
        at_least = -(-characters // self.model.longest_token)
        if at_least >= self.options.context_length:
            raise ApiError(400, f"this model's context is {self.options.context_length} tokens, but "
                                f"the request's text alone needs at least {at_least}",
                           param=param, code="context_length_exceeded")

    # -- the generation --------------------------------------------------------------------

    def submit(self, request: CheckedRequest, prompt_ids: list[int], param: str,
               thought_budget: Optional[int] = None, images: Optional[ImagePrompt] = None,
               score_prompt: bool = False, sender: Optional[Request] = None) -> Job:
        """Queue the generation `request` asks for, once its prompt fits with its answer; a
        chat's (`param` "messages") thoughts are split from its answer (`thinking`);
        `score_prompt`: the prompt's own log-probs come first (`prompt_scores`); `sender`: the
        HTTP request, whose API key (`guards`' tenant) the job carries."""
        max_tokens = completion_budget(len(prompt_ids), request.max_tokens, self.options, param)
        chat, think = param == "messages", self.model.think
        job = Job(prompt_ids, request.sampling, max_tokens, request.stops, asyncio.get_running_loop(),
                  logprobs=request.logprobs, think=think if chat else None,
                  thinking=chat and opens_thought(self.model.tokenizer, think, prompt_ids),
                  thought_budget=thought_budget, keep_alive=request.keep_alive, images=images,
                  grammar=request.grammar, score_prompt=score_prompt,
                  tenant=getattr(sender.state, "tenant", None) if sender is not None else None,
                  skip_ids=frozenset() if request.body.skip_special_tokens is False else self.model.skipped_ids)
        try:
            self.worker.submit(job)
        except (Busy, ShuttingDown) as error:
            raise refusal(error, self.options.queue_size) from None
        return job

    async def collect(self, job: Job, request: Request) -> tuple[list[Piece], Done]:
        """A non-streamed answer's pieces and its `Done` (a `Failed` is raised). Events may
        come every few milliseconds, so the client is checked by the clock, not only when
        the queue is quiet; one that has gone away cancels the job."""
        pieces, checked = [], time.monotonic()
        try:
            while True:
                if time.monotonic() - checked > DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        job.cancelled.set()
                        raise ApiError(499, "client closed the request")
                try:
                    event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, Piece):
                    pieces.append(event)
                elif isinstance(event, Failed):
                    raise ApiError(event.status, event.message,
                                   type="server_error" if event.status >= 500 else "invalid_request_error")
                else:
                    return pieces, event
        finally:
            self.worker.cancel(job)  # a no-op once done; stops the job if this request was dropped

    def splitter(self, request: CheckedRequest) -> CallSplitter:
        """The answer's `CallSplitter`: its calls parsed from its text, whose special tokens
        the worker left out by id (`ServedModel.skipped_ids`) unless the request keeps them.
        The parsers' own markers are text to them: one left over outside a call or thought
        (a stray end marker) is left out too, but under a grammar, which never draws them,
        so its value keeps any such text it spells."""
        skip = request.body.skip_special_tokens is not False and request.wanted is None
        return CallSplitter(request.plan, self.model.markers if skip else ())

    def extra(self, done: Done) -> dict:
        """An answer's extra `mlx_spec` field: the drafter, γ and `statistics`."""
        return {"drafter": self.model.drafter, "gamma": str(self.worker.gamma), **statistics(done)}


def completion_budget(prompt_tokens: int, requested: Optional[int], options: ServerOptions,
                      param: str) -> int:
    """Tokens the answer may have: the request's, else the server's default (`max_tokens`;
    None: the rest of the context, OpenAI's meaning of leaving it out), clamped to the room
    the context leaves after the prompt, as llama.cpp and Ollama clamp it (the answer then
    ends with finish reason `length`). Only a prompt that leaves no room is refused."""
    room = options.context_length - prompt_tokens
    if prompt_tokens == 0:
        raise ApiError(400, "the prompt is empty", param=param)
    if room < 1:  # worded as Anthropic's API words it, which Claude Code recognizes
        raise ApiError(400, f"prompt is too long: {prompt_tokens} tokens > {options.context_length - 1} "
                            f"maximum (this model's context is {options.context_length} tokens, but the "
                            f"request needs {prompt_tokens} prompt tokens and at least one completion token)",
                       param=param, code="context_length_exceeded")
    wanted = requested if requested is not None else options.max_tokens
    return min(wanted if wanted is not None else room, room)


def token_counts(job: Job, done: Done) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of a finished job."""
    return len(job.prompt_ids), done.completion_tokens, cached_count(job, done.prefilled_target)


def statistics(done: Done) -> dict:
    """The speculative statistics in the response's extra `mlx_spec` field, acceptance of
    thought and answer apart included (`thinking.PhaseAcceptance`)."""
    loaded = {} if done.load_seconds is None else {"load_seconds": round(done.load_seconds, 3)}
    return {**done.stats.as_dict(), "prefill_tokens_target": done.prefilled_target,
            **done.phases.as_dict(), "loaded": done.load_seconds is not None, **loaded,
            "batch_size": done.batch_size}
