"""Request-level guards: what every HTTP request passes before any route sees it.

One ASGI middleware, `RequestGuards`, checks in this order and answers without reaching the
app, in OpenAI's error shape or, under a path given in `error_bodies`, that path's API's
shape (Anthropic's under /v1/messages):

1. the Host header (403): a web page that rebinds its own DNS name to this machine's
   address sends `Host: attacker.example`; only loopback names and `allowed_hosts` are
   served (the CLI's: this machine's own names beyond loopback, and `--allowed-hosts`);
2. the API key on every route but /health (401), compared as bytes in constant time, from
   "Authorization: Bearer <key>" (OpenAI's clients) or "x-api-key: <key>" (Anthropic's),
   any of the keys where there are several (the request's `state.tenant` says which:
   a digest of it, for what must not be shared between keys), whatever the method: CORS preflights, which never carry a key, are answered before the
   guards by CORSMiddleware (with `--cors-origin`), so no method needs an exemption;
3. the content type of a request with a body (415): browsers send a cross-origin
   `text/plain` POST without a CORS preflight, so only `application/json` is read;
4. the body size (413), counted while the body arrives, so a huge or chunked body is
   refused after at most `max_body` bytes instead of being buffered whole, and its time
   (408): a client that trickles its body holds a connection and a buffer, so the whole
   body must arrive within `body_timeout` seconds of the request's head.

Routes read the body as usual (`await request.body()`); it was read here and is handed on.
The guards send no CORS headers: unless `--cors-origin` adds `CorsGuard` (Starlette's
CORSMiddleware, refusing in JSON) around them, a browser page from another origin cannot
read any answer. Inside them, `AnswerErrors` turns an exception no route handled into a
500 in the route's shape, the connection kept.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import hmac
import ipaddress
import logging
from typing import Callable, Iterable, Mapping, Optional, Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from mlx_spec.errors import UsageError
from mlx_spec.server.api_error import ApiError

log = logging.getLogger("mlx_spec.server")

MAX_BODY_BYTES = 16 * 1024 * 1024
BODY_TIMEOUT_S = 60.0  # 16 MiB at 2.3 Mbit/s; a typical 100 kB agent request at 14 kbit/s
TRIM_AFTER_BYTES = 1 << 20
TRIM_DELAY_S = 0.5


def _libc_malloc_trim():
    """glibc's malloc_trim, or None (macOS's allocator returns free pages by itself). glibc
    keeps the pages a big body's copies and parse freed (its mmap threshold rises to their
    size): ~90 MiB for a 16 MiB body until trimmed, which takes a few milliseconds."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_malloc_trim()
LOOPBACK_NAMES = ("localhost",)  # IP literals are checked with `ipaddress`
ANY_HOST = "*"
# Load balancers and supervisors probe /health without a key; clients probe the root (Claude
# Code sends `HEAD /` before its first request), which says only that a server is there.
OPEN_PATHS = ("/health", "/")


def check_api_key(key: "Optional[str | Sequence[str]]") -> "Optional[bytes | tuple[bytes, ...]]":
    """The key as the bytes a client sends (several keys: a tuple of them), or a one-line
    error for a key no HTTP client can send (headers are ASCII; spaces and control
    characters do not survive them)."""
    if key is None:
        return None
    if not isinstance(key, str):
        return tuple(check_api_key(k) for k in key) or None
    if not key or not all("!" <= ch <= "~" for ch in key):
        raise UsageError("--api-key (or MLX_SPEC_API_KEY) must be printable ASCII without "
                           "spaces, as it travels in an HTTP header")
    return key.encode("ascii")


def tenant(key: bytes) -> str:
    """Who sent a request, as its API key's digest (the key itself is kept out of jobs)."""
    return hashlib.sha256(key).hexdigest()[:16]


def host_name(host: str) -> str:
    """'example.com' from 'Example.COM:8080', '::1' from '[::1]:8080'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(host: str, allowed: Optional[frozenset[str]]) -> bool:
    if allowed is None or ANY_HOST in allowed:
        return True
    name = host_name(host)
    if name in allowed or name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def error_body(bodies: Mapping[str, Callable[[ApiError], dict]], path: str, error: ApiError) -> dict:
    """`error` as the API under `path` shapes it: the first of `bodies` whose path is `path`
    or lies above it, else OpenAI's shape."""
    for root, body in bodies.items():
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return body(error)
    return error.body()


REFUSAL_KEY = "mlx_spec.refusal"  # the ASGI scope's entry holding the ApiError answered


def refusal_body(bodies: Mapping[str, Callable[[ApiError], dict]], scope, error: ApiError) -> dict:
    """`error_body`, the refusal kept in the request's scope for `metrics.CountResponses` to
    log and count by its reason."""
    scope[REFUSAL_KEY] = error
    return error_body(bodies, scope["path"], error)


class RequestGuards:
    """ASGI middleware over the whole app.

    Args:
        allowed_hosts: Host names served besides loopback ones; None (or "*") serves any.
        api_key: bytes every request but /health must send (see the module docstring), or
            a tuple of such keys, any of which will do.
        max_body: the largest request body read, in bytes.
        body_timeout: seconds the whole body may take to arrive, from the request's head.
        error_bodies: path -> the error body for a refusal on that path or under it (an
            `ApiError` in, a JSON object out); other paths get `ApiError.body`.
    """

    def __init__(self, app, allowed_hosts: Optional[Iterable[str]] = (),
                 api_key: "Optional[bytes | tuple[bytes, ...]]" = None, max_body: int = MAX_BODY_BYTES,
                 body_timeout: float = BODY_TIMEOUT_S,
                 error_bodies: Mapping[str, Callable[[ApiError], dict]] = {}):
        self.app = app
        self.error_bodies = dict(error_bodies)
        self.allowed = None if allowed_hosts is None else frozenset(
            host_name(h) if h != ANY_HOST else h for h in allowed_hosts)
        self.api_keys = (api_key,) if isinstance(api_key, bytes) else tuple(api_key or ())
        self.max_body = max_body
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope["headers"]:  # first of each, as bytes
            headers.setdefault(name.lower(), value)
        try:
            self._check_host(headers)
            if scope["path"] not in OPEN_PATHS and self.api_keys:
                scope.setdefault("state", {})["tenant"] = tenant(self._check_key(headers))
            body = None
            if scope["method"] in ("POST", "PUT", "PATCH"):
                self._check_content_type(headers)
                body = await self._read_body(headers, receive)
                if body is None:  # the client left while sending
                    return
        except ApiError as error:
            response = JSONResponse(refusal_body(self.error_bodies, scope, error),
                                    status_code=error.status,
                                    headers={**error.headers, "Connection": "close"})
            return await response(scope, receive, send)
        if body is None:
            return await self.app(scope, receive, send)

        handed_on, size = False, len(body)

        async def replay():
            nonlocal handed_on, body
            if not handed_on:  # handed on once, and not kept here for the rest of the request
                handed_on, message, body = True, {"type": "http.request", "body": body,
                                                  "more_body": False}, None
                return message
            return await receive()  # later: the disconnect, which streaming answers wait for

        try:
            return await self.app(scope, replay, send)
        finally:
            if size >= TRIM_AFTER_BYTES and _malloc_trim is not None:
                # later: the server's own copies of the body go with the connection
                asyncio.get_running_loop().call_later(TRIM_DELAY_S, _malloc_trim, 0)

    def _check_host(self, headers: dict) -> None:
        host = headers.get(b"host")
        if host is None:  # HTTP/1.0 without Host: no browser sends that
            return
        text = host.decode("latin-1")
        if not host_allowed(text, self.allowed):
            raise ApiError(403, f"the Host {host_name(text)!r} is not served here (only this "
                                "machine's names are, against DNS rebinding; start with "
                                "--allowed-hosts to add names)", code="host_not_allowed")

    def _check_key(self, headers: dict) -> bytes:
        """The key the request sent, one of `api_keys`, else a 401. Every key is compared
        (in constant time), so how long it takes tells nothing of which matched."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        sent = None
        for key in self.api_keys:
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
            if bearer | hmac.compare_digest(headers.get(b"x-api-key", b""), key):
                sent = key
        if sent is None:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer <key> or x-api-key: <key>)",
                           code="invalid_api_key")
        return sent

    def _check_content_type(self, headers: dict) -> None:
        kind = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if kind != b"application/json":
            shown = kind.decode("latin-1") or "none"
            raise ApiError(415, f"the request body must be application/json (Content-Type: "
                                f"{shown})", code="unsupported_media_type")

    async def _read_body(self, headers: dict, receive) -> Optional[bytes]:
        """The whole body, or an `ApiError`: 413 as soon as it passes `max_body`, 408 once
        `body_timeout` has passed."""
        too_big = ApiError(413, f"the request body is larger than {self.max_body // 2**20} MiB",
                           code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body:
            raise too_big
        body = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                    f"({len(body)} bytes came)", code="request_timeout") from None
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                raise too_big
            if not message.get("more_body", False):
                return bytes(body)


class AnswerErrors:
    """ASGI middleware: an exception that no route handled becomes a 500 in the route's
    API shape (logged) and goes no further. Past Starlette's own handler it would reach
    uvicorn, which closes the connection without a word once a response was sent, so the
    client's next request on it, and any it pipelined, would be lost. After a response has
    started only closing can tell the client: the exception is raised on."""

    def __init__(self, app, error_bodies: Mapping[str, Callable[[ApiError], dict]] = {}):
        self.app = app
        self.error_bodies = dict(error_bodies)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if started:
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            error = ApiError(500, "internal server error", type="server_error")
            await JSONResponse(refusal_body(self.error_bodies, scope, error),
                               status_code=500)(scope, receive, send)


class CorsGuard(CORSMiddleware):
    """Starlette's CORSMiddleware, but a preflight it refuses (an origin, method or header
    not allowed) is answered in the route's API error shape, as every other refusal is,
    instead of text/plain."""

    def __init__(self, app, error_bodies: Mapping[str, Callable[[ApiError], dict]] = {},
                 **options):
        super().__init__(app, **options)
        self.error_bodies = dict(error_bodies)

    async def __call__(self, scope, receive, send):
        headers = Headers(scope=scope) if scope["type"] == "http" else {}
        if (scope["type"] != "http" or scope["method"] != "OPTIONS" or "origin" not in headers
                or "access-control-request-method" not in headers):  # not a preflight
            return await super().__call__(scope, receive, send)
        response = self.preflight_response(request_headers=headers)
        if response.status_code == 400:  # its body: "Disallowed CORS origin, headers"
            refused = response.body.decode().removeprefix("Disallowed CORS ")
            error = ApiError(400, f"CORS preflight refused (not allowed: {refused}); "
                                  "--cors-origin names the origins served", code="cors_refused")
            kept = {k: v for k, v in response.headers.items() if k.startswith("access-control-")}
            response = JSONResponse(refusal_body(self.error_bodies, scope, error),
                                    status_code=400, headers=kept)
        await response(scope, receive, send)
