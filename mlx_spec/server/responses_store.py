"""Stored responses (`store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}`): a
bounded in-memory store, the oldest response dropped first.

Each entry keeps the response object and the conversation it ends (its input items, those of
the responses it continued included, then its output items), so a request naming it as
`previous_response_id` continues that conversation; its `instructions` are not carried over,
as in OpenAI's API. Bounds: `max_count` responses and `max_bytes` of their JSON together
(one larger than `max_bytes` is not kept). Nothing survives a restart. The store is used from
the event loop and the parsing thread: a lock guards it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    conversation: list[dict]  # input items, then output items, as JSON values
    size: int  # bytes of both as JSON


class ResponseStore:
    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Keep `response`, dropping the oldest beyond the bounds; False if it alone is too big."""
        size = len(json.dumps([response, conversation], ensure_ascii=False).encode("utf-8"))
        if size > self.max_bytes or self.max_count < 1:
            return False
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = StoredResponse(response, conversation, size)
            self._bytes += size
            while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, rid: str) -> Optional[StoredResponse]:
        with self._lock:
            return self._entries.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
