"""The Anthropic Messages API: `POST /v1/messages` (and `/v1/messages/count_tokens`) over the
same worker as the OpenAI routes.

A request is turned into the chat-template messages the OpenAI route builds (`system` as a
system turn, `tool_use` blocks as an assistant's calls, `tool_result` blocks as tool
turns, `thinking` blocks as the turn's `reasoning_content`), generated the same way (with
`thinking` enabled: the template's enable_thinking on and `budget_tokens` a thought budget,
`worker`), and answered in Anthropic's shapes: a `message` object, or
its event stream (`message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`). Errors come as `{"type": "error", "error": {"type",
"message"}}`, those of `guards.RequestGuards` on these paths too (`error_body`); the key
may come as `x-api-key` or `Authorization: Bearer`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict, Field

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.body_bounds import (
    MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_SEQUENCES, MAX_TOOLS, bounded_stops,
)
from mlx_spec.server.request_base import Items, RequestBody, StrictModel, parse_body
from mlx_spec.server.tools import Call, CallSplitter, ToolPlan, plan_tools, template_call, template_result
from mlx_spec.server.worker import Done, Failed, Piece

PATH = "/v1/messages"  # and what lies under it (count_tokens)
SIGNATURE = ""  # a thinking block's: Anthropic's verifies thoughts sent back; ours are not checked

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               499: "invalid_request_error", 500: "api_error", 503: "overloaded_error"}


# ---------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------


class Block(StrictModel):
    # Any block type parses, so an unsupported one is refused by name.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None
    id: Optional[str] = None  # tool_use
    name: Optional[str] = None
    input: Optional[dict] = None
    thinking: Optional[str] = None  # thinking
    signature: Optional[str] = None
    tool_use_id: Optional[str] = None  # tool_result
    content: Union[str, Items("Block", MAX_CONTENT_PARTS), None] = None
    is_error: Optional[bool] = None
    source: Optional[dict] = None  # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Union[str, Items(Block, MAX_CONTENT_PARTS)]


class AnthropicTool(StrictModel):
    type: Optional[Literal["custom"]] = None  # server tools (web search, bash, ...) are Anthropic's
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: Optional[int] = None


class MessagesRequest(RequestBody):
    MAX_TEMPERATURE: ClassVar[float] = 1.0  # Anthropic's API range
    max_tokens: int = Field(ge=1)  # required by the Messages API
    messages: Items(AnthropicMessage, MAX_MESSAGES, min_length=1)
    system: Union[str, Items(Block, MAX_CONTENT_PARTS), None] = None
    stop_sequences: Optional[Items(str, MAX_STOP_SEQUENCES)] = None
    tools: Optional[Items(AnthropicTool, MAX_TOOLS)] = None
    tool_choice: Optional[ToolChoice] = None
    metadata: Optional[dict] = None
    thinking: Optional[ThinkingConfig] = None
    # Features this server cannot give: refused by name rather than quietly ignored.
    output_config: Optional[dict] = None
    mcp_servers: Optional[Items(Any, MAX_TOOLS)] = None
    container: Union[str, dict, None] = None
    context_management: Optional[dict] = None

    def refuse_unsupported(self) -> None:
        unsupported = [("mcp_servers", bool(self.mcp_servers), "MCP servers are not supported"),
                       ("container", self.container is not None, "containers are not supported"),
                       ("context_management", self.context_management is not None,
                        "context management is not supported")]
        for param, bad, message in unsupported:
            if bad:
                raise ApiError(400, f"{param}: {message}", param=param)

    def output_format(self) -> Optional[tuple[str, Optional[dict]]]:
        """`output_config.format` ({"type": "json_schema", "schema": ...}) as a grammar, or None."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "output_config.format: only {\"type\": \"json_schema\", \"schema\": {...}} "
                                "is supported", param="output_config.format")
        return "json_schema", fmt["schema"]

    def thinking_on(self) -> bool:
        return self.thinking is not None and self.thinking.type == "enabled"

    def template_kwargs(self, think) -> dict:
        """enable_thinking for the template: on with `thinking` enabled, else off (Anthropic's
        default, whatever the tokenizer's). A model with no thought markers cannot think."""
        if self.thinking_on() and think is None:
            raise ApiError(400, "thinking: this model does not think (its tokenizer has no "
                                "thought markers)", param="thinking")
        return {"enable_thinking": self.thinking_on()} if think is not None else {}

    def thought_budget(self) -> Optional[int]:
        """Thought tokens before the thought is closed: less than max_tokens, as Anthropic's
        API requires (its minimum of 1024 is not kept, so small models can take small ones)."""
        if not self.thinking_on():
            return None
        budget = self.thinking.budget_tokens
        if budget is None:
            raise ApiError(400, "thinking.budget_tokens: Field required", param="thinking.budget_tokens")
        if not 1 <= budget < self.max_tokens:
            raise ApiError(400, "thinking.budget_tokens: must be at least 1 and less than max_tokens",
                           param="thinking.budget_tokens")
        return budget

    def stops(self) -> tuple[str, ...]:
        # Anthropic sets no count limit, so only their total length is bounded.
        return bounded_stops(tuple(self.stop_sequences or ()), "stop_sequences")

    def logprob_count(self) -> None:
        return None


class CountRequest(MessagesRequest):
    max_tokens: Optional[int] = None


def _text(content, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, block in enumerate(content):
        if block.type != "text":
            raise ApiError(400, f"{where}[{j}]: {block.type} blocks are not supported here; this "
                                "server takes text only", param=f"{where}[{j}]")
        _check_text(block, f"{where}[{j}]")
    return "".join(block.text for block in content)


def _image_part(block: Block, where: str) -> dict:
    """An image block as the template part `server.images.take_images` reads."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise ApiError(400, f"{where}.source: an image block needs a base64 source with `data` or a url "
                            "source with `url`", param=f"{where}.source")
    return {"type": "image", "url": url, "where": where, "kind": "image"}


def _check_text(block: Block, where: str) -> None:
    if block.text is None:
        raise ApiError(400, f"{where}: a text block needs a string `text`", param=f"{where}.text")
    if not block.text:  # Anthropic's rule and words
        raise ApiError(400, f"{where}.text: text content blocks must be non-empty", param=f"{where}.text")


def template_messages(body: MessagesRequest) -> tuple[list[dict], bool]:
    """The conversation as chat templates take it (OpenAI's roles, Hugging Face's tool
    convention), as `tools.template_messages` builds it for the OpenAI route, and whether
    its last turn is an assistant prefill that the answer continues (Anthropic's
    prefill: the turn stays open; an empty one is no prefill). Refused as Anthropic's API
    refuses them: empty content but in a final assistant turn, tool blocks without
    `tools`, a tool_result answering no tool_use of the message before, a prefill ending
    in whitespace."""
    out = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    called: dict[str, str] = {}  # tool_use id -> function name
    previous: set[str] = set()  # tool_use ids of the message before
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        if not message.content and not (i == last and message.role == "assistant"):
            raise ApiError(400, f"messages[{i}]: all messages must have non-empty content except "
                                "for the optional final assistant message", param=where)
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            previous = set()
            continue
        text, calls, uses, thought, images = [], [], set(), [], False
        for j, block in enumerate(message.content):
            if block.type in ("tool_use", "tool_result") and not body.tools:
                raise ApiError(400, f"{where}[{j}]: requests which include `tool_use` or "
                                    "`tool_result` blocks must define tools", param="tools")
            if block.type == "text":
                _check_text(block, f"{where}[{j}]")
                text.append(block.text)
            elif block.type == "image" and message.role == "user":
                text.append(_image_part(block, f"{where}[{j}]"))  # in its place among the text
                images = True
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                # An earlier thought, for templates that show them (Gemma 4's drops them);
                # a redacted one is Anthropic's ciphertext, which no template can read.
                if block.type == "thinking" and block.thinking:
                    thought.append(block.thinking)
            elif block.type == "tool_use" and message.role == "assistant":
                if not (block.id and block.name):
                    raise ApiError(400, f"{where}[{j}]: a tool_use block needs an `id` and a `name`",
                                   param=f"{where}[{j}]")
                calls.append(template_call(block.id, block.name, block.input or {}))
                called[block.id] = block.name
                uses.add(block.id)
            elif block.type == "tool_result" and message.role == "user":
                if block.tool_use_id not in previous:
                    raise ApiError(400, f"{where}[{j}]: a tool_result block must answer a tool_use "
                                        f"block of the previous message, and {block.tool_use_id!r} "
                                        "answers none", param=f"{where}[{j}].tool_use_id")
                out.append(template_result(block.tool_use_id, called[block.tool_use_id],
                                           _text(block.content, f"{where}[{j}].content")))
            else:
                raise ApiError(400, f"{where}[{j}]: {block.type} blocks are not supported in "
                                    f"{message.role} messages", param=f"{where}[{j}]")
        previous = uses
        if text or calls or message.role == "assistant":
            turn = {"role": message.role, "content": "".join(text) if not images else
                    [{"type": "text", "text": t} if isinstance(t, str) else t for t in text]}
            if thought:
                turn["reasoning_content"] = "".join(thought)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    prefill = body.messages[last].role == "assistant" and "tool_calls" not in out[-1]
    if prefill and not out[-1]["content"]:
        out.pop()  # an empty final assistant turn: the model's turn opens as usual
        return out, False
    if prefill and out[-1]["content"] != out[-1]["content"].rstrip():
        raise ApiError(400, f"messages[{last}]: final assistant content cannot end with trailing "
                            "whitespace", param=f"messages[{last}].content")
    return out, prefill


def tool_plan(body: MessagesRequest, syntax) -> ToolPlan:
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                               **({"description": t.description} if t.description else {})}}
             for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise ApiError(400, "tool_choice.name: a tool choice of type tool needs a name",
                       param="tool_choice.name")
    named = {None: None, "auto": "auto", "any": "required", "none": "none"}
    # A forced tool's input follows its input_schema where the call format is JSON (`tools.py`).
    return plan_tools(tools or None, choice.name if choice and choice.type == "tool"
                      else named[choice.type if choice else None], syntax,
                      single=bool(choice and choice.disable_parallel_tool_use), constrain_forced=True)


# ---------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------


def error_body(error: ApiError) -> dict:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


def stop_reason(done: Done, calls: int) -> str:
    if done.finish_reason == "length":
        return "max_tokens"
    if done.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    # Anthropic counts cache reads apart from input: input + cache reads = the prompt.
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def content_blocks(parts: list) -> list[dict]:
    blocks: list[dict] = []
    for part in parts:
        if isinstance(part, Call):
            blocks.append(tool_use(part))
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += part
        else:
            blocks.append({"type": "text", "text": part})
    return blocks


def thinking_block(thought: str) -> dict:
    return {"type": "thinking", "thinking": thought, "signature": SIGNATURE}


def tool_use(call: Call, input: Optional[dict] = None) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.split("_", 1)[1], "name": call.name,
            "input": call.arguments if input is None else input}


def event(kind: str, data: dict) -> bytes:
    """One event of Anthropic's stream: a named SSE event whose data repeats the type."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


# ---------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------


def add_routes(app, *, options, syntax, think, parsed, check_request, output_grammar, chat_ids, submit,
               collect, cancel, usage_counts, extra) -> None:
    """Mount the Messages API on `app`; the callables are the OpenAI routes' own helpers
    (`parsed(request, read)` -> `read(the raw body)`, off the event loop;
    `chat_ids(messages, plan, queued)` -> (prompt ids, `ImagePrompt` or None), off the event loop, refused while
    the queue is full if `queued`; `cancel(job)` stops a job;
    `usage_counts(job, done)` -> (prompt, completion, cached) tokens; `extra(done)` -> the
    `mlx_spec` statistics field; `think`: the model's `ThinkSyntax` or None;
    `output_grammar(body, plan, template kwargs)` -> the compiled grammar the answer must
    follow, or None)."""

    async def prompt_of(request: Request, model: type, queued: bool) -> tuple:
        def read(raw: bytes) -> tuple:
            body = parse_body(raw, model)
            check_request(body, queued)
            body.refuse_unsupported()
            plan = tool_plan(body, syntax)
            kwargs = body.template_kwargs(think)
            grammar = output_grammar(body, plan, kwargs) if queued else None
            return (body, plan, *template_messages(body), kwargs, grammar)

        body, plan, messages, prefill, kwargs, grammar = await parsed(request, read)
        return body, plan, grammar, *await chat_ids(messages, plan, queued, continue_final=prefill,
                                                    template_kwargs=kwargs)

    @app.post(PATH + "/count_tokens")
    async def count_tokens(request: Request):
        try:
            _, _, _, ids, _ = await prompt_of(request, CountRequest, queued=False)
        except ApiError as error:
            return error_response(error)
        return {"input_tokens": len(ids)}

    @app.post(PATH)
    async def messages(request: Request):
        try:
            body, plan, grammar, ids, images = await prompt_of(request, MessagesRequest, queued=True)
            job = submit(body, ids, "messages", thought_budget=body.thought_budget(), images=images,
                         grammar=grammar)
            mid = "msg_" + uuid.uuid4().hex[:24]
            if body.stream:
                return StreamingResponse(stream(job, mid, plan), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            pieces, done = await collect(job, request)
        except ApiError as error:
            return error_response(error)
        splitter = CallSplitter(plan)
        parts = splitter.feed("".join(p.text for p in pieces)) + splitter.finish()
        counts = usage_counts(job, done)
        thought = "".join(p.reasoning for p in pieces)
        return {"id": mid, "type": "message", "role": "assistant", "model": options.model_name,
                "content": [thinking_block(thought)] * bool(thought) + content_blocks(parts), "stop_reason": stop_reason(done, splitter.calls),
                "stop_sequence": done.stop_string, "usage": usage(*counts),
                "mlx_spec": extra(done)}

    async def stream(job, mid: str, plan: ToolPlan):
        splitter = CallSplitter(plan)
        index, open_block = 0, None  # the kind of the block being streamed: "text", "thinking"

        def close():
            nonlocal index, open_block
            if open_block == "thinking":  # Anthropic's stream signs a thought before its stop
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "signature_delta", "signature": SIGNATURE}})
            if open_block is not None:
                yield event("content_block_stop", {"index": index})
                index, open_block = index + 1, None

        def delta(kind: str, text: str):
            nonlocal open_block
            if open_block != kind:
                yield from close()
                start = {"type": "text", "text": ""} if kind == "text" else thinking_block("")
                yield event("content_block_start", {"index": index, "content_block": start})
                open_block = kind
            yield event("content_block_delta", {"index": index, "delta": (
                {"type": "text_delta", "text": text} if kind == "text"
                else {"type": "thinking_delta", "thinking": text})})

        try:
            item = await job.events.get()
            # After the first event the prompt's split into input and cache reads is known:
            # it goes here, once, as in Anthropic's stream (message_delta adds output tokens).
            if not isinstance(item, Failed):
                yield event("message_start", {"message": {
                    "id": mid, "type": "message", "role": "assistant", "model": options.model_name,
                    "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": usage(len(job.prompt_ids), 0, job.cached_tokens or 0)}})
            while True:
                if isinstance(item, Failed):
                    kind = ERROR_TYPES.get(item.status, "api_error")
                    yield event("error", {"error": {"type": kind, "message": item.message}})
                    return
                if isinstance(item, Piece) and item.reasoning:
                    for out in delta("thinking", item.reasoning):
                        yield out
                parts = splitter.feed(item.text) if isinstance(item, Piece) else splitter.finish()
                for part in parts:
                    if isinstance(part, str):
                        for out in delta("text", part):
                            yield out
                        continue
                    for out in close():
                        yield out
                    yield event("content_block_start", {"index": index, "content_block": tool_use(part, {})})
                    yield event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(part.arguments, ensure_ascii=False)}})
                    yield event("content_block_stop", {"index": index})
                    index += 1
                if isinstance(item, Done):
                    for out in close():
                        yield out
                    counts = usage_counts(job, item)
                    yield event("message_delta", {
                        "delta": {"stop_reason": stop_reason(item, splitter.calls),
                                  "stop_sequence": item.stop_string},
                        "usage": {"output_tokens": counts[1]}, "mlx_spec": extra(item)})
                    yield event("message_stop", {})
                    return
                item = await job.events.get()
        finally:
            cancel(job)  # the client went away, or the answer is complete
