"""`mlx-spec serve`: an OpenAI- and Anthropic-compatible HTTP server over one engine.

    app = create_app(engine, tokenizer, ServerOptions(model_name="default"))
    uvicorn.run(app, host="127.0.0.1", port=8080)

`guards` checks every request first (Host, API key, content type, body size); the wire
format is `body_bounds` (what a body may hold, checked on its bytes), `request_base` and
`openai_requests` (request models), `openai_responses` and `logprobs` (answers) and
`api_error` (the error shape); `worker`
the single generation thread with its bounded queue and long-lived caches (`caches`: several
conversations at once), `app` the routes, `tools` tool calls (mlx-lm's parsers),
`anthropic` the Messages API, `metrics` `GET /metrics`.
"""

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.app import ServerOptions, create_app

__all__ = ["ApiError", "ServerOptions", "create_app"]
