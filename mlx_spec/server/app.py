"""The app: `create_app` builds the serving objects over one `serving.ServingContext` and
mounts their routes (`/v1/chat/completions` and `/v1/completions`: `serving_openai`;
Anthropic's `/v1/messages`: `serving_anthropic`; OpenAI's `/v1/responses`: `serving_responses`; `/health`, `/metrics`, `/v1/models`:
`ServerStatus`), behind the guards.

Every request first passes `guards.RequestGuards` (Host, API key, content type, body
size and time), inside `guards.CorsGuard` when `--cors-origin` is given. An `ApiError` a
route raises is answered in its API's error shape (`Serving.error_bodies`; OpenAI's
elsewhere), and so is an unknown route or a wrong method.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.guards import AnswerErrors, CorsGuard, RequestGuards, check_api_key, refusal_body
from mlx_spec.server.metrics import CountResponses
from mlx_spec.server.options import ServerOptions
from mlx_spec.server.serving import Serving, ServingContext
from mlx_spec.server.serving_anthropic import AnthropicServing
from mlx_spec.server.serving_openai import OpenAIServing
from mlx_spec.server.serving_responses import ResponsesServing

__all__ = ["ServerOptions", "create_app"]

APIS = (OpenAIServing, AnthropicServing, ResponsesServing)  # each API's serving class, its routes mounted in order


class ServerStatus(Serving):
    """`/` and `/health` (no key needed), `/metrics` (Prometheus' text) and `/v1/models`."""

    def add_routes(self, app: FastAPI) -> None:
        app.api_route("/", methods=["GET", "HEAD"])(self.root)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.get("/v1/models")(self.models)

    async def root(self):
        return {"status": "ok"}  # as Ollama's "Ollama is running": a client's probe, no key needed

    async def health(self):
        """200 with the worker's counts; 503 ("unhealthy", and why) when the generation
        thread has ended or a running job has made no progress for a long time, so a load
        balancer or supervisor takes this server out instead of queueing on it forever."""
        problem = self.worker.problem()
        status = {"status": "ok" if problem is None else "unhealthy",
                  "model": self.options.public_name or self.options.model_name,
                  "drafter": self.model.drafter, "gamma": str(self.worker.gamma),
                  "tokenizing": self.tokenizing.now, **self.worker.health()}
        if problem is not None:
            return JSONResponse({**status, "problem": problem}, status_code=503)
        return status

    async def metrics(self):
        return PlainTextResponse(self.worker.metrics.render(self.worker.health()),
                                 media_type="text/plain; version=0.0.4")

    async def models(self):
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "mlx-spec",
             "loaded": self.worker.engine is not None}
            for name in (self.options.model_name, *self.options.aliases)]}


def create_app(engine, tokenizer, options: ServerOptions, load=None) -> FastAPI:
    """An ASGI app serving `engine` (run it with uvicorn). The generation worker starts and
    stops with the app's lifespan. `load()` makes the engine again after a keep-alive
    unload (None: the models stay loaded)."""
    # Nothing below may hold `engine`: a keep-alive unload must find its weights unreferenced.
    context = ServingContext.of(engine, tokenizer, options, load)

    @asynccontextmanager
    async def lifespan(app):
        context.start()
        yield
        context.stop()

    app = FastAPI(title="mlx-spec", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker = context.worker
    error_bodies = {path: body for api in APIS for path, body in api.error_bodies.items()}
    # The last added is the outermost: responses are counted, then CORS headers go on every
    # answer to an allowed origin (the guards' refusals and 500s too, so a page can read
    # why), then unhandled errors become 500s, then the guards run before any route. A
    # preflight is answered by CorsGuard itself.
    app.add_middleware(RequestGuards, allowed_hosts=options.allowed_hosts,
                       api_key=check_api_key(options.api_key), body_timeout=options.body_timeout,
                       error_bodies=error_bodies)
    app.add_middleware(AnswerErrors, error_bodies=error_bodies)
    if options.cors_origins:
        app.add_middleware(CorsGuard, error_bodies=error_bodies,
                           allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"], max_age=600)
    app.add_middleware(CountResponses, metrics=context.worker.metrics)

    def error_response(request, error: ApiError) -> JSONResponse:
        return JSONResponse(refusal_body(error_bodies, request.scope, error),
                            status_code=error.status, headers=error.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return error_response(request, error)

    @app.exception_handler(HTTPException)
    async def _http_error(request, error: HTTPException):  # unknown routes, wrong methods
        return error_response(request, ApiError(error.status_code, str(error.detail),
                                                headers=getattr(error, "headers", None)))

    for serving in (ServerStatus, *APIS):
        serving(context).add_routes(app)
    return app
