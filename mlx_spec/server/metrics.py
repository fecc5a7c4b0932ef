"""`GET /metrics`: the server's counters in Prometheus' text exposition format.

HTTP responses by status code, refusals (4xx) by status and reason (the error's code, else
its type; each also logged in one line: `CountResponses`), generations by outcome, queue depth, prompt and decode tokens with the seconds they took
(tokens/s is their ratio; Prometheus' rate() of each gives it over any window), drafted and
accepted tokens, acceptance **by position** (`stats` definitions: rounds whose draft token
i was accepted / rounds that drafted at least i), prompt-cache reuse, and the decode batch
(requests running, and rows per target forward: batch_rows / batch_forwards is the mean
batch size).
"""

from __future__ import annotations

import logging
import threading

from mlx_spec.core.stats import Stats
from mlx_spec.server.guards import REFUSAL_KEY

log = logging.getLogger("mlx_spec.server")

PREFIX = "mlx_spec_"


class Metrics:
    """Totals over every finished generation; `observe` runs on the worker thread,
    `render` on the event loop, hence the lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.total = Stats()
        self.cached_tokens = 0
        self.cache_hits = 0
        self.responses: dict[int, int] = {}  # HTTP status -> responses sent
        self.refusals: dict[tuple[int, str], int] = {}  # (4xx status, reason) -> responses sent
        self.batch_forwards = 0  # target forwards of the worker's batch (one per round)
        self.batch_rows = 0  # requests' verify blocks those forwards held

    def observe_batch(self, rows: int) -> None:
        with self.lock:
            self.batch_forwards += 1
            self.batch_rows += rows

    def observe_response(self, status: int, reason: str | None = None) -> None:
        with self.lock:
            self.responses[status] = self.responses.get(status, 0) + 1
            if reason is not None:
                self.refusals[status, reason] = self.refusals.get((status, reason), 0) + 1

    def observe(self, stats: Stats, cached_tokens: int) -> None:
        with self.lock:
            t = self.total
            for name in ("rounds", "drafted", "accepted", "generated", "prompt_tokens",
                         "prefill_tokens", "prefill_time", "decode_time", "grammar_forced"):
                setattr(t, name, getattr(t, name) + getattr(stats, name))
            for mine, theirs in ((t.drafted_at, stats.drafted_at), (t.accepted_at, stats.accepted_at)):
                mine += [0] * (len(theirs) - len(mine))
                for i, n in enumerate(theirs):
                    mine[i] += n
            for mine, theirs in ((t.drafted_from, stats.drafted_from), (t.accepted_from, stats.accepted_from)):
                for source, n in theirs.items():
                    mine[source] = mine.get(source, 0) + n
            self.cached_tokens += cached_tokens
            self.cache_hits += cached_tokens > 0

    def render(self, health: dict) -> str:
        """The exposition text; `health` is the worker's (outcome counts, queue, caches)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples) -> None:
            full = PREFIX + name + ("_total" if kind == "counter" else "")  # the format's convention
            lines.append(f"# HELP {full} {help}")
            lines.append(f"# TYPE {full} {kind}")
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"{full}{label} {value}")

        with self.lock:
            t = self.total
            metric("http_responses", "counter", "HTTP responses by status code.",
                   [({"code": str(code)}, n) for code, n in sorted(self.responses.items())])
            metric("refusals", "counter", "Requests refused (4xx) by status and reason.",
                   [({"code": str(code), "reason": reason}, n) for (code, reason), n in sorted(self.refusals.items())])
            metric("requests", "counter", "Generation requests by outcome.",
                   [({"outcome": k}, health[k]) for k in ("completed", "cancelled", "failed", "refused")])
            metric("queue_depth", "gauge", "Requests waiting for the device.", [({}, health["queued"])])
            metric("busy", "gauge", "1 while a request generates.", [({}, int(health["busy"]))])
            metric("running", "gauge", "Requests decoding together now.", [({}, health["running"])])
            metric("parallel", "gauge", "Requests that may decode together (serve --parallel).",
                   [({}, health["parallel"])])
            metric("batch_forwards", "counter", "Target forwards of the decode batch.", [({}, self.batch_forwards)])
            metric("batch_rows", "counter", "Requests those forwards verified (rows / forwards: mean batch size).",
                   [({}, self.batch_rows)])
            metric("prompt_tokens", "counter", "Prompt tokens of finished requests.", [({}, t.prompt_tokens)])
            metric("prefill_tokens", "counter", "Prompt tokens processed (the rest came from a cache).",
                   [({}, t.prefill_tokens)])
            metric("prefill_seconds", "counter", "Time spent processing prompts.", [({}, t.prefill_time)])
            metric("generated_tokens", "counter", "Tokens generated.", [({}, t.generated)])
            metric("decode_seconds", "counter", "Time spent generating (prompt processing excluded).",
                   [({}, t.decode_time)])
            metric("prefill_tokens_per_second", "gauge", "Prompt tokens processed per second, all requests.",
                   [({}, t.prefill_tps)])
            metric("decode_tokens_per_second", "gauge", "Tokens generated per second, all requests.",
                   [({}, t.decode_tps)])
            metric("rounds", "counter", "Verify passes of the target.", [({}, t.rounds)])
            metric("drafted_tokens", "counter", "Draft tokens proposed.", [({}, t.drafted)])
            metric("accepted_tokens", "counter", "Draft tokens accepted.", [({}, t.accepted)])
            metric("grammar_forced_tokens", "counter", "Tokens a grammar forced, drafted free (structured output).",
                   [({}, t.grammar_forced)])
            metric("source_drafted_tokens", "counter", "Draft tokens proposed, by where the drafter found them "
                   "(suffix: context, this request's text; memory, earlier requests').",
                   [({"source": k}, n) for k, n in sorted(t.drafted_from.items())])
            metric("source_accepted_tokens", "counter", "Draft tokens accepted, by where the drafter found them.",
                   [({"source": k}, n) for k, n in sorted(t.accepted_from.items())])
            positions = [{"position": str(i + 1)} for i in range(len(t.drafted_at))]
            metric("position_drafted", "counter", "Rounds that drafted at least this many tokens.",
                   zip(positions, t.drafted_at))
            metric("position_accepted", "counter", "Rounds whose draft token at this position was accepted.",
                   zip(positions, t.accepted_at))
            metric("acceptance_by_position", "gauge", "Accepted / drafted at each draft position.",
                   zip(positions, t.acceptance_by_position))
            metric("prompt_cache_hits", "counter", "Requests that reused cached prompt tokens.",
                   [({}, self.cache_hits)])
            metric("prompt_cache_tokens", "counter", "Prompt tokens read from a cache.", [({}, self.cached_tokens)])
            metric("prompt_caches", "gauge", "Conversations cached.", [({}, health["prompt_caches"])])
            metric("prompt_cache_bytes", "gauge", "KV bytes the cached conversations hold.",
                   [({}, health["prompt_cache_bytes"])])
        return "\n".join(lines) + "\n"


class CountResponses:
    """ASGI middleware counting responses by status into `metrics` (a plain ASGI wrapper:
    Starlette's BaseHTTPMiddleware would get between a streamed answer and its client).
    It sits outside `guards.AnswerErrors`, so an exception no route handled reaches it as
    that middleware's 500 response and is counted like any other."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                status, reason = message["status"], None
                if 400 <= status < 500:
                    reason = refusal_line(scope, status)
                self.metrics.observe_response(status, reason)
            await send(message)

        await self.app(scope, receive, counted)


def refusal_line(scope, status: int) -> str:
    """Log a refused request in one line (method, path, status, reason, parameter and the
    error's message; never the body or a header) and return its reason: the error's code,
    else its type ("refused" for a 4xx no `ApiError` made, such as a CORS preflight's)."""
    error = scope.get(REFUSAL_KEY)
    reason = (error.code or error.type) if error is not None else "refused"
    detail = "" if error is None else f" ({error.param})" * bool(error.param) + f": {error.message}"
    log.warning("%s %s %d %s%s", scope.get("method"), scope.get("path"), status, reason, detail[:300])
    return reason
