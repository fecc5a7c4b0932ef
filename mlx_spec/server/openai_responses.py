"""OpenAI's response objects: a whole answer (`chat.completion`, `text_completion`), a
streamed chunk, the usage chunk that ends a stream, and the Server-Sent Event carrying each."""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_object(chat: bool, rid: str, model: str, text: str, finish: Optional[str],
                      usage_: dict, extra: dict, reasoning: str = "") -> dict:
    """A whole answer: `chat.completion` or `text_completion`; `extra` is the mlx_spec field,
    `reasoning` the thought (a chat message's `reasoning_content`, as vLLM and llama.cpp)."""
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if reasoning:
            choice["message"]["reasoning_content"] = reasoning
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_, "mlx_spec": extra}


def chunk_object(chat: bool, rid: str, model: str, created: int, *, text: Optional[str] = None,
                 role: bool = False, finish: Optional[str] = None, reasoning: str = "") -> dict:
    """One streamed piece: `chat.completion.chunk` (a delta) or `text_completion`."""
    choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        delta: dict = {"role": "assistant"} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(chat: bool, rid: str, model: str, created: int, usage_: dict, extra: dict) -> dict:
    """The last streamed object when stream_options.include_usage is set: no choices."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_,
            "mlx_spec": extra}


def sse(obj) -> bytes:
    """One Server-Sent Event carrying a JSON object (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")
