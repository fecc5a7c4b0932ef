"""The Anthropic Messages API: `POST /v1/messages` (and `/v1/messages/count_tokens`) over the
same worker as the OpenAI routes.

A request becomes the chat-template messages the OpenAI route builds
(`anthropic_requests.template_messages`), is generated the same way (with `thinking`
enabled: the template's enable_thinking on and `budget_tokens` a thought budget, `worker`),
and is answered in Anthropic's shapes (`anthropic_responses`): a `message` object, or its
event stream. Errors come as `{"type": "error", "error": {"type", "message"}}`, those of
`guards.RequestGuards` on these paths too (`error_bodies`); the key may come as
`x-api-key` or `Authorization: Bearer`.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from mlx_spec.server.anthropic_requests import CountRequest, MessagesRequest, template_messages, tool_plan
from mlx_spec.server.anthropic_responses import (
    BlockEvents,
    content_blocks,
    error_body,
    event,
    failed_event,
    stop_reason,
    thinking_block,
    usage,
)
from mlx_spec.server.jobs import Done, Failed, Job, Piece
from mlx_spec.server.request_base import parse_body
from mlx_spec.server.serving import SSE_HEADERS, CheckedRequest, Conversation, Serving, token_counts
from mlx_spec.server.tools import CallSplitter, ToolPlan

PATH = "/v1/messages"  # and what lies under it (count_tokens)


class AnthropicServing(Serving):
    """Anthropic's messages and count_tokens routes."""

    error_bodies = {PATH: error_body}

    def add_routes(self, app: FastAPI) -> None:
        app.post(PATH + "/count_tokens")(self.count_tokens)
        app.post(PATH)(self.messages)

    async def count_tokens(self, request: Request):
        _, ids, _ = await self._prompt(request, CountRequest, queued=False)
        return {"input_tokens": len(ids)}

    async def messages(self, request: Request):
        checked, ids, images = await self._prompt(request, MessagesRequest, queued=True)
        job = self.submit(checked, ids, "messages", thought_budget=checked.body.thought_budget(),
                          images=images, sender=request)
        mid = "msg_" + uuid.uuid4().hex[:24]
        if checked.body.stream:
            return StreamingResponse(self._stream(job, mid, self.splitter(checked)), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        pieces, done = await self.collect(job, request)
        splitter = self.splitter(checked)
        parts = splitter.feed("".join(p.text for p in pieces)) + splitter.finish()
        counts = token_counts(job, done)
        thought = "".join(p.reasoning for p in pieces)
        return {"id": mid, "type": "message", "role": "assistant", "model": self.options.model_name,
                "content": [thinking_block(thought)] * bool(thought) + content_blocks(parts),
                "stop_reason": stop_reason(done, splitter.calls),
                "stop_sequence": done.stop_string, "usage": usage(*counts), "mlx_spec": self.extra(done)}

    async def _prompt(self, request: Request, model: type, queued: bool) -> tuple:
        """(the checked request, None unless `queued`; prompt ids; `ImagePrompt` or None)."""
        checked, plan, conversation = await self.parsed(request, self._read, model, queued)
        if queued:
            checked = await self.compiled(checked)
        return (checked, *await self.chat_ids(conversation, plan, queued))

    def _read(self, raw: bytes, model: type,
              queued: bool) -> tuple[Optional[CheckedRequest], ToolPlan, Conversation]:
        """The body checked and templated; a generation's (`queued`) checked whole, a count's
        only for its model name."""
        body = parse_body(raw, model)
        checked = self.validate(body) if queued else None
        if not queued:
            self.check_model(body)
        body.refuse_unsupported()
        plan = tool_plan(body, self.model.tool_syntax)
        kwargs = body.template_kwargs(self.model.think)
        if queued:
            checked = replace(checked, plan=plan, wanted=self.output_grammar(body, plan, kwargs))
        messages, prefill = template_messages(body)
        return checked, plan, Conversation(messages, continue_final=prefill, template_kwargs=kwargs)

    async def _stream(self, job: Job, mid: str, splitter: CallSplitter):
        blocks = BlockEvents()
        try:
            item = await job.events.get()
            # After the first event the prompt's split into input and cache reads is known:
            # it goes here, once, as in Anthropic's stream (message_delta adds output tokens).
            if not isinstance(item, Failed):
                yield event("message_start", {"message": {
                    "id": mid, "type": "message", "role": "assistant", "model": self.options.model_name,
                    "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": usage(len(job.prompt_ids), 0, job.cached_tokens or 0)}})
            while True:
                if isinstance(item, Failed):
                    yield failed_event(item)
                    return
                if isinstance(item, Piece) and item.reasoning:
                    for out in blocks.delta("thinking", item.reasoning):
                        yield out
                parts = splitter.feed(item.text) if isinstance(item, Piece) else splitter.finish()
                for part in parts:
                    for out in blocks.delta("text", part) if isinstance(part, str) else blocks.tool_use(part):
                        yield out
                if isinstance(item, Done):
                    for out in blocks.close():
                        yield out
                    yield event("message_delta", {
                        "delta": {"stop_reason": stop_reason(item, splitter.calls),
                                  "stop_sequence": item.stop_string},
                        "usage": {"output_tokens": token_counts(job, item)[1]}, "mlx_spec": self.extra(item)})
                    yield event("message_stop", {})
                    return
                item = await job.events.get()
        finally:
            self.worker.cancel(job)  # the client went away, or the answer is complete
