"""Anthropic's response shapes: a `message` object's parts, the events of its stream
(`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`; `BlockEvents` numbers and closes the content blocks), and its error body
`{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import json
from typing import Optional

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.jobs import Done, Failed
from mlx_spec.server.tools import Call

SIGNATURE = ""  # a thinking block's: Anthropic's verifies thoughts sent back; ours are not checked

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               499: "invalid_request_error", 500: "api_error", 503: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


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


def failed_event(failed: Failed) -> bytes:
    """A stream's error event: the job failed after the stream began."""
    return event("error", {"error": {"type": ERROR_TYPES.get(failed.status, "api_error"),
                                     "message": failed.message}})


class BlockEvents:
    """The content-block events of one streamed message. A text or thinking block opens when
    the kind of text changes and stays open while it goes on; a thinking block is signed
    before it stops, as Anthropic's stream signs a thought; each tool call is a block of its
    own, its whole input in one delta."""

    def __init__(self):
        self.index = 0  # the next block's, or the open one's
        self.open: Optional[str] = None  # the kind of the block being streamed: "text", "thinking"

    def delta(self, kind: str, text: str) -> list[bytes]:
        """`text` of `kind` ("text" or "thinking"), in a block of its kind."""
        out = []
        if self.open != kind:
            out += self.close()
            start = {"type": "text", "text": ""} if kind == "text" else thinking_block("")
            out.append(event("content_block_start", {"index": self.index, "content_block": start}))
            self.open = kind
        out.append(event("content_block_delta", {"index": self.index, "delta": (
            {"type": "text_delta", "text": text} if kind == "text"
            else {"type": "thinking_delta", "thinking": text})}))
        return out

    def tool_use(self, call: Call) -> list[bytes]:
        """A tool call's block, start to stop."""
        out = self.close()
        out.append(event("content_block_start", {"index": self.index, "content_block": tool_use(call, {})}))
        out.append(event("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}}))
        out.append(event("content_block_stop", {"index": self.index}))
        self.index += 1
        return out

    def close(self) -> list[bytes]:
        """Stop the open block, if one is."""
        out = []
        if self.open == "thinking":
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": SIGNATURE}}))
        if self.open is not None:
            out.append(event("content_block_stop", {"index": self.index}))
            self.index, self.open = self.index + 1, None
        return out
