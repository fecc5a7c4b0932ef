"""`ApiError`: every refusal of a request, from the guards to the routes, answered in
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}` (or, under a path
that has its own, that API's shape: `guards.error_body`)."""

from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """An error answered in OpenAI's shape; `headers` travel with it (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
