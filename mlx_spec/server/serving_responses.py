"""OpenAI's Responses API, the wire protocol of Codex CLI: `POST /v1/responses` (whole or
streamed), `GET` and `DELETE /v1/responses/{id}`, and `POST /v1/responses/{id}/cancel`,
over the same worker, prompt caches, grammar and tool parsing as chat completions.

A request's input items become the chat-template messages of the same conversation sent to
chat completions (`responses_requests.template_conversation`), so its greedy answer is the
same; the answer is read as chat completions reads it (thoughts split out by the worker,
calls by `tools.CallSplitter`) and given as output items (`responses_output.OutputItems`):
a `reasoning` item for Gemma 4's thought, a `message`, a `function_call` per call. With
`store` (OpenAI's default) the response and its conversation are kept
(`responses_store.ResponseStore`) for `previous_response_id` and `GET`. Errors take OpenAI's
shape; `background` responses are not supported, so only a finished response exists to be
read, and cancelling one is refused as OpenAI refuses cancelling a response that was not
created in the background.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.jobs import Done, Failed, Job
from mlx_spec.server.logprobs import AnswerBytes, logprobs_object
from mlx_spec.server.request_base import parse_body
from mlx_spec.server.responses_output import OutputItems, new_id, response_object, sse, usage
from mlx_spec.server.responses_requests import InputItem, ResponsesRequest, template_conversation, tool_plan
from mlx_spec.server.responses_store import ResponseStore
from mlx_spec.server.serving import SSE_HEADERS, CheckedRequest, Conversation, Serving, token_counts
from mlx_spec.server.tools import Call, CallSplitter

PATH = "/v1/responses"


@dataclass(frozen=True)
class ResponsesCall:
    """A checked request: what `create` needs besides the generation's `CheckedRequest`."""

    checked: CheckedRequest
    conversation: Conversation
    namespaces: dict  # function name -> its namespace
    history: list  # the conversation's input items as JSON (a stored response's first)


class ResponsesServing(Serving):
    """The Responses API's routes, with the store of finished responses."""

    def __init__(self, context):
        super().__init__(context)
        self.store = ResponseStore()

    def add_routes(self, app: FastAPI) -> None:
        app.post(PATH)(self.create)
        app.get(PATH + "/{rid}")(self.retrieve)
        app.delete(PATH + "/{rid}")(self.delete)
        app.post(PATH + "/{rid}/cancel")(self.cancel)

    # -- the routes ------------------------------------------------------------------------

    async def create(self, request: Request):
        call: ResponsesCall = await self.parsed(request, self._read)
        checked = await self.compiled(call.checked)
        call = replace(call, checked=checked)
        try:
            ids, images = await self.chat_ids(call.conversation, checked.plan)
            job = self.submit(checked, ids, "messages", images=images, sender=request)
        except ApiError as error:  # the shared steps name chat completions' `messages`
            if error.param and error.param.startswith("messages"):
                error.param = "input"
            raise
        rid, created = new_id("resp"), int(time.time())
        if checked.body.stream:
            return StreamingResponse(self._stream(job, call, rid, created), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        pieces, done = await self.collect(job, request)
        answer = Answer(self, job, call)
        for event in pieces + [done]:
            answer.read(event)
        response = answer.response(rid, created, done)
        self._keep(call, response)
        return response

    async def retrieve(self, rid: str):
        return self._stored(rid).response

    async def delete(self, rid: str):
        if not self.store.delete(rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def cancel(self, rid: str):
        self._stored(rid)
        raise ApiError(400, f"response {rid!r} was not created with background=true, so it cannot be "
                            "cancelled (this server has no background responses)", param="response_id",
                       code="invalid_request")

    # -- the body (on the parsing thread) --------------------------------------------------

    def _read(self, raw: bytes) -> ResponsesCall:
        body = parse_body(raw, ResponsesRequest)
        checked = self.validate(body)
        body.refuse_unsupported()
        plan, namespaces = tool_plan(body, self.model.tool_syntax)
        kwargs = body.template_kwargs(self.model.think)
        checked = replace(checked, plan=plan, wanted=self.output_grammar(body, plan, kwargs))
        history = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise ApiError(404, f"Previous response with id {body.previous_response_id!r} not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = stored.conversation
        items = body.input_items()
        earlier = [InputItem.model_validate(item) for item in history]
        messages = template_conversation(earlier + items, body.instructions, self.model.tool_syntax,
                                         first=len(earlier))
        history = history + [item.model_dump(exclude_none=True, by_alias=True) for item in items]
        return ResponsesCall(checked, Conversation(messages, template_kwargs=kwargs), namespaces, history)

    # -- the answer ------------------------------------------------------------------------

    async def _stream(self, job: Job, call: ResponsesCall, rid: str, created: int):
        answer = Answer(self, job, call)
        items = answer.items
        try:
            start = answer.response(rid, created, None)
            yield sse(items.lifecycle("created", start))
            yield sse(items.lifecycle("in_progress", start))
            while True:
                event = await job.events.get()
                for out in answer.read(event):
                    yield sse(out)
                if isinstance(event, (Done, Failed)):
                    response = answer.response(rid, created, event)
                    kind = {"completed": "completed", "incomplete": "incomplete"}.get(response["status"], "failed")
                    self._keep(call, response)  # before the last event: a client may go once it has it
                    yield sse(items.lifecycle(kind, response))
                    return
        finally:
            # Reached when the answer is complete and when Starlette cancels this generator
            # because the client disconnected: either way the worker may stop the job.
            self.worker.cancel(job)

    def _keep(self, call: ResponsesCall, response: dict) -> None:
        if call.checked.body.store is not False and response["status"] in ("completed", "incomplete"):
            self.store.put(response, call.history + response["output"])

    def _stored(self, rid: str):
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        return stored


class Answer:
    """One answer read from its job's events into output items (`OutputItems`), calls split
    from text, log-probs in the API's shape; `read` returns the stream events each gives."""

    def __init__(self, serving: ResponsesServing, job: Job, call: ResponsesCall):
        self.serving, self.job, self.call = serving, job, call
        self.items = OutputItems(call.namespaces)
        self.splitter = serving.splitter(call.checked)
        self.answer_bytes = AnswerBytes(serving.model.trims_first_space, job.skip_ids)

    def read(self, event) -> list[dict]:
        if isinstance(event, Failed):
            return self.items.finish("incomplete")
        if isinstance(event, Done):
            events = self._parts(self.splitter.finish(), [])
            return events + self.items.finish("incomplete" if event.finish_reason == "length" else "completed")
        scored = []
        if self.job.logprobs is not None and event.logprobs:
            scored = logprobs_object(True, event.logprobs, self.serving.model.describe, self.answer_bytes)["content"]
        return self.items.reasoning(event.reasoning) + self._parts(self.splitter.feed(event.text), scored)

    def _parts(self, parts: list, scored: list) -> list[dict]:
        events = []
        if not any(isinstance(part, str) for part in parts):
            events += self.items.text("", scored)  # kept for the next text
        for part in parts:
            if isinstance(part, Call):
                events += self.items.call(part)
            else:
                events += self.items.text(part, scored)
                scored = []
        return events

    def response(self, rid: str, created: int, end: Optional[object]) -> dict:
        """The response object: in progress (`end` None), or as `end` (Done, Failed) left it."""
        serving, checked = self.serving, self.call.checked
        status, counts, extra, error = "in_progress", None, None, None
        if isinstance(end, Failed):
            status, error = "failed", {"code": "server_error", "message": end.message}
        elif isinstance(end, Done):
            status = {"stop": "completed", "length": "incomplete"}.get(end.finish_reason, "cancelled")
            counts, extra = usage(*token_counts(self.job, end)), serving.extra(end)
        output = self.items.output if end is not None else []
        return response_object(rid, created, serving.options.model_name, checked.body, status, output,
                               counts, extra, error, checked.sampling)


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id {rid!r} not found.", param="response_id", code="not_found")
