"""The Responses API's answers: the `response` object, its output items (a `reasoning`
item for the thought, a `message` with one `output_text` part, a `function_call` per call),
and the Server-Sent Events that stream them.

`OutputItems` builds the output as the answer arrives, each step also giving the events that
announce it, in the order the official SDK's stream accumulator and Codex read them:

    response.created, response.in_progress
    per item: response.output_item.added
        message:   response.content_part.added, response.output_text.delta ...,
                   response.output_text.done, response.content_part.done
        reasoning: response.content_part.added, response.reasoning_text.delta ...,
                   response.reasoning_text.done, response.content_part.done
        function_call: response.function_call_arguments.delta, ...arguments.done
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Every event carries a `sequence_number`, from 0. A non-streamed answer is built by the same
steps, its events unused, so the two cannot differ.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from mlx_spec.server.tools import Call


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The Responses API's usage. Thought tokens are counted in output_tokens; they are not
    counted apart (the worker releases text, not a per-phase token count)."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def sse(event: dict) -> bytes:
    """One Server-Sent Event, named by its type as OpenAI's stream names them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode("utf-8")


class OutputItems:
    """A response's output items as the answer arrives; each method returns the events
    (dicts, numbered) that say what it did."""

    def __init__(self, namespaces: Optional[dict[str, str]] = None):
        self.output: list[dict] = []
        self.sequence = 0
        self._open: Optional[dict] = None  # the item receiving deltas, if any
        self._pending_logprobs: list = []  # log-probs of tokens whose text is not out yet
        self._namespaces = namespaces or {}

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def lifecycle(self, kind: str, response: dict) -> dict:
        """response.created / in_progress / completed / incomplete / failed."""
        return self.event(f"response.{kind}", response=response)

    def reasoning(self, text: str) -> list[dict]:
        if not text:
            return []
        events = self._ensure("reasoning")
        part = self._open["content"][0]
        part["text"] += text
        return events + [self.event("response.reasoning_text.delta", item_id=self._open["id"],
                                    output_index=len(self.output) - 1, content_index=0, delta=text)]

    def text(self, text: str, logprobs: list) -> list[dict]:
        """Answer text and the log-probs of the tokens it was read from (those of tokens not
        yet shown as text wait for the next text)."""
        self._pending_logprobs += logprobs
        if not text:
            return []
        events = self._ensure("message")
        part = self._open["content"][0]
        part["text"] += text
        scored, self._pending_logprobs = self._pending_logprobs, []
        part["logprobs"] += scored
        return events + [self.event("response.output_text.delta", item_id=self._open["id"],
                                    output_index=len(self.output) - 1, content_index=0, delta=text,
                                    logprobs=scored)]

    def call(self, call: Call) -> list[dict]:
        events = self._close("completed")
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call.id, "name": call.name, "arguments": ""}
        if call.name in self._namespaces:
            item["namespace"] = self._namespaces[call.name]
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        item.update(arguments=arguments, status="completed")
        return events + [
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=arguments),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=item)]

    def finish(self, status: str) -> list[dict]:
        """Close the open item (`status`: its status, "completed" or "incomplete")."""
        events = []
        if self._pending_logprobs and self._open is not None and self._open["type"] == "message":
            # the tokens that ended the text (an EOS): an empty delta carries them
            scored, self._pending_logprobs = self._pending_logprobs, []
            self._open["content"][0]["logprobs"] += scored
            events.append(self.event("response.output_text.delta", item_id=self._open["id"],
                                     output_index=len(self.output) - 1, content_index=0, delta="",
                                     logprobs=scored))
        return events + self._close(status)

    def _ensure(self, kind: str) -> list[dict]:
        """Events opening an item of `kind` (and closing another), or none if one is open."""
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close("completed")
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=_copy(part)))
        item["content"].append(part)
        self._open = item
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        part = item["content"][0]
        item["status"] = status
        if item["type"] == "message":
            done = self.event("response.output_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"], logprobs=part["logprobs"])
        else:
            done = self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"])
        return [done,
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                           content_index=0, part=_copy(part)),
                self.event("response.output_item.done", output_index=index, item=_copy(item))]


def _copy(value: dict) -> dict:
    """A snapshot of an item or part, so later deltas do not change an event already made."""
    return json.loads(json.dumps(value))


def response_object(rid: str, created_at: int, model: str, request, status: str, output: list[dict],
                    usage_: Optional[dict] = None, extra: Optional[dict] = None,
                    error: Optional[dict] = None, sampling=None) -> dict:
    """The `response` object: the request's settings echoed, its output, status and usage.
    `request`: the `ResponsesRequest`; `sampling`: its checked `SamplingParams`."""
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
    choice = request.tool_choice
    reasoning = request.reasoning
    out = {
        "id": rid, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "model": model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
        "store": request.store is not False,
        "temperature": sampling.temperature if sampling is not None else request.temperature,
        "text": {"format": (request.text.format.model_dump(exclude_none=True, by_alias=True)
                            if request.text is not None and request.text.format is not None
                            else {"type": "text"})},
        "tool_choice": choice.model_dump(exclude_none=True) if hasattr(choice, "model_dump") else (choice or "auto"),
        "tools": tools,
        "top_logprobs": request.top_logprobs,
        "top_p": sampling.top_p if sampling is not None else request.top_p,
        "truncation": request.truncation or "disabled",
        "usage": usage_,
        "user": request.user,
        "metadata": request.metadata or {},
    }
    if extra is not None:
        out["mlx_spec"] = extra
    return out
