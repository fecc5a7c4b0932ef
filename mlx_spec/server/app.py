"""The HTTP side: FastAPI routes for `/v1/models`, `/v1/chat/completions`,
`/v1/completions`, Anthropic's `/v1/messages` (`anthropic`), `/metrics` and `/health`,
streaming as Server-Sent Events.

Every request first passes `guards.RequestGuards` (Host, API key, content type, body
size and time), inside `guards.CorsGuard` when `--cors-origin` is given. Handlers run on
the event loop and never touch MLX: they parse and check the request and build its
template messages (on a parsing thread: a 16 MiB body is up to a second of CPU work),
tokenize the prompt (on a tokenizer thread, so a big prompt does not stall other clients,
and before queueing, so errors such as a prompt over the context are answered at once), hand a `Job` to the `Worker` and relay its events. A full queue is a 503 with
Retry-After, checked before tokenizing: a prompt being tokenized holds its place in the
queue, and count_tokens' prompts wait for the tokenizer only while fewer than
`queue_size` do, so a burst of big prompts cannot line up more tokenizer work than the
queue takes. A client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from mlx_spec.errors import UsageError
from mlx_spec.grammar import compile_grammar, llg_tokenizer
from mlx_spec.models.fast_tokenizer import trims_first_space
from mlx_spec.sampling import SamplingParams
from mlx_spec.server import anthropic
from mlx_spec.server.guards import (
    BODY_TIMEOUT_S, AnswerErrors, CorsGuard, RequestGuards, check_api_key, error_body,
)
from mlx_spec.server.images import content_texts, take_images
from mlx_spec.server.metrics import CountResponses
from mlx_spec.server.prompt import ChatPrompts
from mlx_spec.server.api_error import ApiError
from mlx_spec.server.logprobs import AnswerBytes, logprobs_object, token_describer
from mlx_spec.server.openai_requests import ChatRequest, CompletionRequest
from mlx_spec.server.openai_responses import (
    chunk_object, completion_object, new_id, sse, usage, usage_chunk,
)
from mlx_spec.server.request_base import parse_body
from mlx_spec.server.tools import (
    Call, CallSplitter, ToolPlan, openai_call, openai_plan, template_messages, tool_syntax,
)
from mlx_spec.server.worker import (
    FOREVER, SHUTTING_DOWN, Busy, Done, Failed, Job, Piece, ShuttingDown, Worker, cached_count,
)
from mlx_spec.thinking import opens_thought, think_syntax
from mlx_spec.vision import ImageError, ImagePrompt

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks for its client


@dataclass
class ServerOptions:
    """What the server serves and how.

    Attributes:
        model_name: the served name: the first id in `/v1/models` and the "model" of every
            answer; requests must name it (or an alias).
        aliases: other names accepted in a request's "model" field (e.g. the preset), listed
            after it in `/v1/models`.
        public_name: the name /health shows, as it needs no key (None: model_name); the
            CLI passes a local model path's last part only.
        gamma: "auto" or a whole number as text.
        defaults: sampling values for fields a request leaves out.
        max_tokens: completion length when a request gives none.
        context_length: prompt plus completion tokens the model takes.
        queue_size: requests that may wait while `parallel` generate.
        parallel: requests decoded together (`worker.Worker`); 1: one at a time.
        api_key: if set, every request but /health needs "Authorization: Bearer <key>" (or
            "x-api-key: <key>"); printable ASCII (`guards.check_api_key`).
        allowed_hosts: Host names served besides loopback ones; None serves any.
        cache_budget: bytes of KV the cached conversations may hold (None: from the
            device's free memory; see `worker.Worker`).
        cors_origins: origins whose browser pages may call the API (none by default).
        parse_special_in_text: read control-token text in messages ("<start_of_turn>") as
            control tokens; off, it is text and only the chat template writes them
            (`prompt.ChatPrompts`).
        body_timeout: seconds a request's whole body may take to arrive (then 408).
        keep_alive: idle seconds before the models are unloaded (`worker.FOREVER`: never);
            needs `create_app`'s `load`.
        allow_image_urls: fetch images that requests name by http(s) URL (off: a 400).
        allow_image_files: read images that requests name by local path or file: URL (off: a 400).
        prompt_cache_dir: a folder for cached conversations that outlive the server (None:
            memory only); prompt_cache_disk: the bytes its files may take.
    """

    model_name: str
    aliases: tuple[str, ...] = ()
    gamma: str = "auto"
    defaults: SamplingParams = SamplingParams()
    max_tokens: int = 512
    context_length: int = 8192
    queue_size: int = 8
    parallel: int = 1  # `serve` defaults to 4
    api_key: Optional[str] = None
    allowed_hosts: Optional[tuple[str, ...]] = ()
    public_name: Optional[str] = None
    cache_budget: Optional[int] = None
    cors_origins: tuple[str, ...] = ()
    parse_special_in_text: bool = False
    body_timeout: float = BODY_TIMEOUT_S
    keep_alive: float = FOREVER
    allow_image_urls: bool = False
    allow_image_files: bool = False
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk: int = 10 * 2**30


def create_app(engine, tokenizer, options: ServerOptions, load=None) -> FastAPI:
    """An ASGI app serving `engine` (run it with uvicorn). The generation worker starts and
    stops with the app's lifespan. `load()` makes the engine again after a keep-alive
    unload (None: the models stay loaded)."""
    worker = Worker(engine, tokenizer, options.gamma, options.queue_size, options.cache_budget,
                    load=load, keep_alive=options.keep_alive, cache_dir=options.prompt_cache_dir,
                    cache_disk=options.prompt_cache_disk, parallel=options.parallel)
    drafter = engine.drafter.name if engine.drafter is not None else "none"
    # No closure below may hold `engine`: a keep-alive unload must find its weights unreferenced.
    eos_ids = engine.eos_ids
    vocab = tokenizer.get_vocab()
    vocab_size = len(vocab)  # ids the detokenizer knows
    # No token's text is longer than its vocabulary entry in UTF-8 (byte-level and
    # SentencePiece entries spell a byte or space with one or more bytes).
    longest_token = max(len(piece.encode("utf-8")) for piece in vocab)
    gamma_mode = worker.gamma
    syntax = tool_syntax(tokenizer)
    think = think_syntax(tokenizer)
    describe = token_describer(tokenizer, eos_ids)
    trims = trims_first_space(tokenizer)
    prompts = ChatPrompts(tokenizer, parse_special=options.parse_special_in_text)
    # The processor needs no weights: it stays while a keep-alive unload drops the models.
    prompter = engine.vision.prompter if engine.vision is not None else None
    # One thread: the tokenizer is not shared between request threads, only with the worker.
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-spec-tokenize")
    # One thread: parsing holds the GIL for most of its work, so more would not be faster,
    # only hold more parsed bodies at once.
    parsing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-spec-parse")

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        # llguidance's view of the tokenizer takes seconds to build (Gemma's 262k ids): built
        # now, on the parsing thread, rather than by the first structured request.
        parsing.submit(llg_tokenizer, tokenizer, eos_ids)
        yield
        worker.stop()
        tokenizing.shutdown(wait=False, cancel_futures=True)
        parsing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="mlx-spec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker = worker
    # The last added is the outermost: responses are counted, then CORS headers go on every
    # answer to an allowed origin (the guards' refusals and 500s too, so a page can read
    # why), then unhandled errors become 500s, then the guards run before any route. A
    # preflight is answered by CorsGuard itself.
    error_bodies = {anthropic.PATH: anthropic.error_body}  # OpenAI's shape elsewhere
    app.add_middleware(RequestGuards, allowed_hosts=options.allowed_hosts,
                       api_key=check_api_key(options.api_key), body_timeout=options.body_timeout,
                       error_bodies=error_bodies)
    app.add_middleware(AnswerErrors, error_bodies=error_bodies)
    if options.cors_origins:
        app.add_middleware(CorsGuard, error_bodies=error_bodies,
                           allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600)
    app.add_middleware(CountResponses, metrics=worker.metrics)

    # Prompts on or waiting for the tokenizer thread, and how many of them are for the
    # queue (changed on the event loop only).
    tokenizing_now = tokenizing_queued = 0

    async def tokenized(function, *args, queued: bool = True):
        """`function(*args)` on the tokenizer thread, or a 503 first, so the tokenizer's
        backlog stays bounded (the executor's own queue has none). A prompt for the queue
        (`queued`) holds its place there from now on: refused if the queue, with the prompts
        tokenizing for it, is full. Another (count_tokens') is refused once `queue_size`
        prompts are tokenizing."""
        nonlocal tokenizing_now, tokenizing_queued
        if queued:
            try:
                worker.check_room(coming=tokenizing_queued)
            except (Busy, ShuttingDown) as error:
                raise refusal(error) from None
        elif tokenizing_now >= options.queue_size:
            raise busy(f"{tokenizing_now} prompts being tokenized", retry_after=1)
        tokenizing_now, tokenizing_queued = tokenizing_now + 1, tokenizing_queued + queued
        try:
            return await asyncio.get_running_loop().run_in_executor(tokenizing, function, *args)
        finally:
            tokenizing_now, tokenizing_queued = tokenizing_now - 1, tokenizing_queued - queued

    def busy(why: str, retry_after: int) -> ApiError:
        return ApiError(503, f"the server is busy ({why}); retry later", type="server_error",
                        code="server_busy", headers={"Retry-After": str(retry_after)})

    def refusal(error: Exception) -> ApiError:
        """The 503 for the worker's `Busy` or `ShuttingDown`."""
        if isinstance(error, ShuttingDown):
            return ApiError(503, SHUTTING_DOWN.message, type="server_error", code="shutting_down")
        return busy(f"{options.queue_size} requests waiting", error.retry_after)

    # -- errors in OpenAI's shape (Anthropic's under its path) ---------------------------

    def error_response(request, error: ApiError) -> JSONResponse:
        return JSONResponse(error_body(error_bodies, request.url.path, error),
                            status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return error_response(request, error)

    @app.exception_handler(HTTPException)
    async def _http_error(request, error: HTTPException):  # unknown routes, wrong methods
        return error_response(request, ApiError(error.status_code, str(error.detail),
                                                headers=getattr(error, "headers", None)))

    # -- routes --------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": options.public_name or options.model_name,
                "drafter": drafter, "gamma": gamma_mode, "tokenizing": tokenizing_now,
                **worker.health()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(worker.metrics.render(worker.health()),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "mlx-spec",
             "loaded": worker.engine is not None}
            for name in (options.model_name, *options.aliases)]}

    async def parsed(request: Request, read):
        """`read(the request's body)` on the parsing thread: parsing, checks and templating,
        none of which may hold the event loop."""
        raw = await request.body()
        return await asyncio.get_running_loop().run_in_executor(parsing, read, raw)

    def read_chat(raw: bytes) -> tuple:
        body = parse_body(raw, ChatRequest)
        check_request(body)
        plan = openai_plan(body, syntax)
        kwargs = body.template_kwargs()
        return (body, plan, template_messages(body.messages, syntax), body.prompt_mode(),
                kwargs, output_grammar(body, plan, kwargs))

    def read_completion(raw: bytes) -> tuple:
        body = parse_body(raw, CompletionRequest)
        check_request(body)
        return body, output_grammar(body)

    def output_grammar(body, plan: ToolPlan = ToolPlan(), template_kwargs: Optional[dict] = None):
        """The compiled grammar the answer must follow (on the parsing thread): a forced
        strict call's (`tools.forced_call_grammar`), else the body's output format, else
        None. One that cannot compile is a 400 naming the feature, and so is a grammar
        with thinking on (`template_kwargs`' enable_thinking): it would hold from the first
        token, so the thought would be forced into the answer's shape or not be written."""
        if plan.grammar is not None:
            kind, source, param = "lark", plan.grammar, "tools"
        else:
            wanted = body.output_format()
            if wanted is None:
                return None
            (kind, source), param = wanted, ("response_format" if hasattr(body, "response_format")
                                             else "output_config.format")
        if (template_kwargs or {}).get("enable_thinking"):
            raise ApiError(400, f"{param}: structured output cannot be combined with thinking yet (the "
                                "grammar would hold from the first token, the thought's); turn thinking off",
                           param=param, code="thinking_with_structured_output")
        try:
            return compile_grammar(tokenizer, kind, source, eos_ids)
        except UsageError as error:
            raise ApiError(400, f"{param}: {error}", param=param, code="invalid_value") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, plan, messages, (continue_final, generation_prompt), kwargs, grammar = await parsed(request, read_chat)
        ids, images = await chat_ids(messages, plan, continue_final=continue_final,
                                     generation_prompt=generation_prompt, template_kwargs=kwargs)
        return await serve(request, body, ids, chat=True, plan=plan, images=images, grammar=grammar)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, grammar = await parsed(request, read_completion)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            check_length(len(prompt), "prompt")
            ids = list(await tokenized(tokenizer.encode, prompt))
        else:
            ids = list(prompt)
            if any(not 0 <= t < vocab_size for t in ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})", param="prompt")
        return await serve(request, body, ids, chat=False, grammar=grammar)

    async def chat_ids(messages: list[dict], plan: ToolPlan, queued: bool = True,
                       continue_final: bool = False, generation_prompt: bool = True,
                       template_kwargs: Optional[dict] = None) -> tuple[list[int], Optional[ImagePrompt]]:
        """The conversation's prompt ids (`ChatPrompts.ids`) and, if it has images, its
        `ImagePrompt` (whose ids they are), made off the event loop once its text could fit
        the context (and, `queued`, once the queue has room: see `tokenized`)."""
        check_length(sum(len(text) for m in messages for text in content_texts(m["content"])), "messages")
        return await tokenized(chat_prompt, messages, plan, continue_final, generation_prompt,
                               template_kwargs, queued=queued)

    def chat_prompt(messages, plan, continue_final, generation_prompt, template_kwargs):
        messages, images = take_images(messages, prompter, options.allow_image_urls,
                                       options.allow_image_files)
        ids = prompts.ids(messages, plan, continue_final, generation_prompt, template_kwargs)
        if not images:
            return ids, None
        try:
            image_prompt = prompter.prompt(ids, images)
        except ImageError as error:
            raise ApiError(400, f"messages: {error}", param="messages") from None
        return image_prompt.ids, image_prompt

    def check_length(characters: int, param: str) -> None:
        """Refuse, before templating or tokenizing it, text that cannot fit the context:
        it needs at least characters / longest_token tokens."""
        at_least = -(-characters // longest_token)
        if at_least >= options.context_length:
            raise ApiError(400, f"this model's context is {options.context_length} tokens, but "
                                f"the request's text alone needs at least {at_least}",
                           param=param, code="context_length_exceeded")

    def check_request(body, queued: bool = True) -> None:
        """The checks that need no tokens, so a wrong request gets its 400 before any 503
        and any tokenizing: the model's name and, for a generation (`queued`), its sampling
        values, stop strings and log-probs (`submit` reads them again: it is cheap)."""
        if body.model != options.model_name and body.model not in options.aliases:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{options.model_name!r}", param="model", code="model_not_found")
        if queued:
            body.sampling(options.defaults)
            body.stops()
            body.logprob_count()
            body.keep_alive_seconds()

    def submit(body, prompt_ids: list[int], param: str, thought_budget: Optional[int] = None,
               images: Optional[ImagePrompt] = None, grammar=None) -> Job:
        """Queue a generation for `body` (its sampling fields, stops and budget checked);
        a chat's thoughts are split from its answer (`thinking`); `grammar`: the compiled
        grammar its answer must follow (`output_grammar`), or None."""
        params = body.sampling(options.defaults)
        max_tokens = completion_budget(len(prompt_ids), body.requested_tokens(), options, param)
        chat = param == "messages"
        job = Job(prompt_ids, params, max_tokens, body.stops(), asyncio.get_running_loop(),
                  logprobs=body.logprob_count(), think=think if chat else None,
                  thinking=chat and opens_thought(tokenizer, think, prompt_ids),
                  thought_budget=thought_budget, keep_alive=body.keep_alive_seconds(), images=images,
                  grammar=grammar)
        try:
            worker.submit(job)
        except (Busy, ShuttingDown) as error:
            raise refusal(error) from None
        return job

    async def collect(job: Job, request: Request) -> tuple[list[Piece], Done]:
        """A non-streamed answer's pieces and its `Done` (a `Failed` is raised)."""
        pieces, checked = [], [time.monotonic()]
        try:
            while True:
                event = await next_event(job, request, checked)
                if isinstance(event, Piece):
                    pieces.append(event)
                elif isinstance(event, Failed):
                    raise ApiError(event.status, event.message,
                                   type="server_error" if event.status >= 500 else "invalid_request_error")
                else:
                    return pieces, event
        finally:
            worker.cancel(job)  # a no-op once done; stops the job if this request was dropped

    async def serve(request: Request, body, prompt_ids: list[int], chat: bool,
                    plan: ToolPlan = ToolPlan(), images: Optional[ImagePrompt] = None, grammar=None):
        job = submit(body, prompt_ids, "messages" if chat else "prompt", images=images, grammar=grammar)
        rid = new_id("chatcmpl" if chat else "cmpl")
        extra_base = {"drafter": drafter, "gamma": gamma_mode}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                stream(job, chat, rid, include_usage, extra_base, plan),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces, event = await collect(job, request)
        splitter = CallSplitter(plan)
        parts = splitter.feed("".join(p.text for p in pieces)) + splitter.finish()
        text = "".join(p for p in parts if isinstance(p, str))
        calls = [openai_call(c) for c in parts if isinstance(c, Call)]
        scored = [lp for p in pieces for lp in p.logprobs]
        answer = completion_object(chat, rid, options.model_name, text,
                                   "tool_calls" if calls and event.finish_reason == "stop" else event.finish_reason,
                                   usage_of(job, event), {**extra_base, **statistics(event)},
                                   reasoning="".join(p.reasoning for p in pieces))
        if job.logprobs is not None:
            answer["choices"][0]["logprobs"] = logprobs_object(chat, scored, describe, AnswerBytes(trims))
        if calls:
            answer["choices"][0]["message"].update(content=text or None, tool_calls=calls)
        return answer

    anthropic.add_routes(
        app, options=options, syntax=syntax, think=think, parsed=parsed, check_request=check_request,
        output_grammar=output_grammar, chat_ids=chat_ids,
        submit=submit, collect=collect, cancel=worker.cancel, usage_counts=token_counts,
        extra=lambda done: {"drafter": drafter, "gamma": gamma_mode, **statistics(done)})

    async def stream(job: Job, chat: bool, rid: str, include_usage: bool, extra_base: dict,
                     plan: ToolPlan):
        created = int(time.time())
        name = options.model_name
        splitter, calls, answer = CallSplitter(plan), 0, AnswerBytes(trims)

        def pieces(parts: list, scored: list, reasoning: str = ""):
            nonlocal calls
            text = "".join(p for p in parts if isinstance(p, str))
            if text or scored or reasoning:
                chunk = chunk_object(chat, rid, name, created, text=text if text or not reasoning else None,
                                     reasoning=reasoning)
                if job.logprobs is not None:
                    chunk["choices"][0]["logprobs"] = logprobs_object(chat, scored, describe, answer)
                yield sse(chunk)
            for call in (p for p in parts if isinstance(p, Call)):
                chunk = chunk_object(chat, rid, name, created)
                chunk["choices"][0]["delta"]["tool_calls"] = [openai_call(call, calls)]
                calls += 1
                yield sse(chunk)

        try:
            if chat:
                yield sse(chunk_object(chat, rid, name, created, text="", role=True))
            while True:
                event = await job.events.get()
                if isinstance(event, Piece):
                    for out in pieces(splitter.feed(event.text), event.logprobs, event.reasoning):
                        yield out
                elif isinstance(event, Failed):
                    yield sse(ApiError(event.status, event.message, type="server_error").body())
                    break
                else:  # the finish chunk carries the statistics, usage or not
                    for out in pieces(splitter.finish(), []):
                        yield out
                    finish = event.finish_reason
                    last = chunk_object(chat, rid, name, created,
                                        finish="tool_calls" if calls and finish == "stop" else finish)
                    yield sse({**last, "mlx_spec": {**extra_base, **statistics(event)}})
                    if include_usage:
                        yield sse(usage_chunk(chat, rid, name, created, usage_of(job, event),
                                              {**extra_base, **statistics(event)}))
                    break
            yield sse("[DONE]")
        finally:
            # Reached when the answer is complete and when Starlette cancels this generator
            # because the client disconnected: either way the worker may stop the job.
            worker.cancel(job)

    return app


async def next_event(job: Job, request: Request, checked: list):
    """The job's next event; cancels the job if the client has disconnected. Events may come
    every few milliseconds, so the client is checked by the clock (`checked` holds the time
    of the last check), not only when the queue is quiet."""
    while True:
        if time.monotonic() - checked[0] > DISCONNECT_POLL_S:
            checked[0] = time.monotonic()
            if await request.is_disconnected():
                job.cancelled.set()
                raise ApiError(499, "client closed the request")
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            pass


def completion_budget(prompt_tokens: int, requested: Optional[int], options: ServerOptions,
                      param: str) -> int:
    """Tokens the answer may have: the request's (or the server's default), within context."""
    room = options.context_length - prompt_tokens
    if prompt_tokens == 0:
        raise ApiError(400, "the prompt is empty", param=param)
    if room < 1 or (requested is not None and requested > room):
        asked = f" plus {requested} completion tokens" if requested is not None else ""
        raise ApiError(400, f"this model's context is {options.context_length} tokens, but the "
                            f"request needs {prompt_tokens} prompt tokens{asked}",
                       param=param, code="context_length_exceeded")
    return min(requested or options.max_tokens, room)


def usage_of(job: Job, done: Done) -> dict:
    return usage(*token_counts(job, done))


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
