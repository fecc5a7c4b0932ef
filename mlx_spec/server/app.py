"""The HTTP side: FastAPI routes for `/v1/models`, `/v1/chat/completions`,
`/v1/completions` and `/health`, streaming as Server-Sent Events.

Handlers run on the event loop and never touch MLX: they parse and check the request,
tokenize the prompt (here, so errors such as a prompt over the context are answered before
queueing), hand a `Job` to the `Worker` and relay its events. A full queue is a 503 with
Retry-After; a client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from mlx_spec.sampling import SamplingParams
from mlx_spec.server import anthropic
from mlx_spec.server.metrics import CountResponses
from mlx_spec.server.protocol import (
    ApiError, ChatRequest, CompletionRequest, chunk_object, completion_object, logprobs_object,
    new_id, parse_body, sse, usage, usage_chunk,
)
from mlx_spec.server.tools import (
    Call, CallSplitter, ToolPlan, openai_call, openai_plan, template_messages, tool_syntax,
)
from mlx_spec.server.worker import Busy, Done, Failed, Job, Piece, Worker

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks for its client


@dataclass
class ServerOptions:
    """What the server serves and how.

    Attributes:
        model_name: the id in `/v1/models`; requests must name it (or an alias).
        aliases: other names accepted in a request's "model" field (e.g. the preset).
        gamma: "auto" or a whole number as text.
        defaults: sampling values for fields a request leaves out.
        max_tokens: completion length when a request gives none.
        context_length: prompt plus completion tokens the model takes.
        queue_size: requests that may wait while one generates.
        api_key: if set, every /v1 request needs "Authorization: Bearer <key>" (or, as
            Anthropic's clients send it, "x-api-key: <key>").
        info: what /health reports about the loaded models (target, draft, preset).
        cache_budget: bytes of KV the cached conversations may hold (None: from the
            device's free memory; see `worker.Worker`).
        cors_origins: origins whose browser pages may call the API (none by default).
    """

    model_name: str
    aliases: tuple[str, ...] = ()
    gamma: str = "auto"
    defaults: SamplingParams = SamplingParams()
    max_tokens: int = 512
    context_length: int = 8192
    queue_size: int = 8
    api_key: Optional[str] = None
    info: dict = field(default_factory=dict)
    cache_budget: Optional[int] = None
    cors_origins: tuple[str, ...] = ()


def create_app(engine, tokenizer, options: ServerOptions) -> FastAPI:
    """An ASGI app serving `engine` (run it with uvicorn). The generation worker starts and
    stops with the app's lifespan."""
    worker = Worker(engine, tokenizer, options.gamma, options.queue_size, options.cache_budget)
    drafter = engine.drafter.name if engine.drafter is not None else "none"
    vocab_size = len(tokenizer.get_vocab())  # ids the detokenizer knows
    gamma_mode = worker.gamma
    syntax = tool_syntax(tokenizer)
    token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: decode_token(tokenizer, t))

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="mlx-spec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker = worker
    app.add_middleware(CountResponses, metrics=worker.metrics)
    if options.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600)

    # -- errors in OpenAI's shape --------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, error: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request, error: Exception):
        return JSONResponse(ApiError(500, "internal server error", type="server_error").body(),
                            status_code=500)

    def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if "x-api-key" in request.headers:
            scheme, token = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), options.api_key):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    # -- routes --------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": options.model_name, "models": options.info,
                "drafter": drafter, "gamma": gamma_mode, **worker.health()}

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request)
        return PlainTextResponse(worker.metrics.render(worker.health()),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        card = {"id": options.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "mlx-spec"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = parse_body(await request.body(), ChatRequest)
        check_model(body)
        plan = openai_plan(body, syntax)
        messages = template_messages(body.messages)
        return await serve(request, body, chat_prompt(tokenizer, messages, plan), chat=True,
                           plan=plan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = parse_body(await request.body(), CompletionRequest)
        check_model(body)
        if isinstance(body.prompt, str):
            ids = list(tokenizer.encode(body.prompt))
        else:
            ids = list(body.prompt)
            if any(not 0 <= t < vocab_size for t in ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})", param="prompt")
        return await serve(request, body, ids, chat=False)

    def check_model(body) -> None:
        if body.model != options.model_name and body.model not in options.aliases:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{options.model_name!r}", param="model", code="model_not_found")

    def submit(body, prompt_ids: list[int], param: str) -> Job:
        """Queue a generation for `body` (its sampling fields, stops and budget checked)."""
        params = body.sampling(options.defaults)
        max_tokens = completion_budget(len(prompt_ids), body.requested_tokens(), options, param)
        job = Job(prompt_ids, params, max_tokens, body.stops(), asyncio.get_running_loop(),
                  logprobs=body.logprob_count())
        try:
            worker.submit(job)
        except Busy as busy:
            raise ApiError(503, f"the server is busy ({options.queue_size} requests waiting); "
                                "retry later", type="server_error", code="server_busy",
                           headers={"Retry-After": str(busy.retry_after)}) from None
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
            job.cancelled.set()  # a no-op once done; stops the job if this request was dropped

    async def serve(request: Request, body, prompt_ids: list[int], chat: bool,
                    plan: ToolPlan = ToolPlan()):
        job = submit(body, prompt_ids, "messages" if chat else "prompt")
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
                                   usage_of(job, event), {**extra_base, **statistics(event)})
        if job.logprobs is not None:
            answer["choices"][0]["logprobs"] = logprobs_object(chat, scored, token_text)
        if calls:
            answer["choices"][0]["message"].update(content=text or None, tool_calls=calls)
        return answer

    anthropic.add_routes(
        app, options=options, tokenizer=tokenizer, syntax=syntax, authorize=authorize,
        check_model=check_model, chat_prompt=chat_prompt, submit=submit, collect=collect,
        usage_counts=token_counts,
        extra=lambda done: {"drafter": drafter, "gamma": gamma_mode, **statistics(done)})

    async def stream(job: Job, chat: bool, rid: str, include_usage: bool, extra_base: dict,
                     plan: ToolPlan):
        created = int(time.time())
        name = options.model_name
        splitter, calls, offset = CallSplitter(plan), 0, [0]

        def pieces(parts: list, scored: list):
            nonlocal calls
            text = "".join(p for p in parts if isinstance(p, str))
            if text or scored:
                chunk = chunk_object(chat, rid, name, created, text=text)
                if job.logprobs is not None:
                    chunk["choices"][0]["logprobs"] = logprobs_object(chat, scored, token_text, offset)
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
                    for out in pieces(splitter.feed(event.text), event.logprobs):
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
            job.cancelled.set()

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


def chat_prompt(tokenizer, messages: list[dict], plan: ToolPlan = ToolPlan()) -> list[int]:
    """The messages (and the plan's tools) through the model's chat template, as `mlx-spec
    generate --chat` encodes a single user message (`stream.encode_prompt`); a forced tool
    call's start marker ends the prompt."""
    try:
        tools = {"tools": plan.tools} if plan.tools else {}
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **tools))
        if plan.forced:
            ids += tokenizer.encode(plan.syntax.start, add_special_tokens=False)
    except Exception as error:  # jinja's TemplateError (roles must alternate, ...), ValueError
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ApiError(400, f"messages: the chat template rejected them: {reason}",
                       param="messages") from None
    return list(ids)


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


def decode_token(tokenizer, token: int) -> str:
    """One token's text for log-probs; ids past the tokenizer's vocabulary have none."""
    try:
        return tokenizer.decode([token])
    except Exception:  # an id the tokenizer lacks (checkpoints pad the embedding)
        return ""


def usage_of(job: Job, done: Done) -> dict:
    return usage(*token_counts(job, done))


def token_counts(job: Job, done: Done) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of a finished job."""
    prompt = len(job.prompt_ids)
    # The target prefills all but the prompt's last token (the first verify pass feeds it).
    cached = max(0, prompt - 1 - done.prefilled_target)
    return prompt, done.completion_tokens, cached


def statistics(done: Done) -> dict:
    """The speculative statistics in the response's extra `mlx_spec` field."""
    return {**done.stats.as_dict(), "prefill_tokens_target": done.prefilled_target}
