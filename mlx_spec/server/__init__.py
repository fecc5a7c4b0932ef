"""`mlx-spec serve`: an OpenAI- and Anthropic-compatible HTTP server over one engine.

    app = create_app(engine, tokenizer, ServerOptions(model_name="default"))
    uvicorn.run(app, host="127.0.0.1", port=8080)

`guards` checks every request first (Host, API key, content type, body size), `protocol`
has the wire format (request checks, response objects, error shape), `worker`
the single generation thread with its bounded queue and long-lived caches (`caches`: several
conversations at once), `app` the routes, `tools` tool calls (mlx-lm's parsers),
`anthropic` the Messages API, `metrics` `GET /metrics`.
"""

from mlx_spec.server.app import ServerOptions, create_app
from mlx_spec.server.protocol import ApiError

__all__ = ["ApiError", "ServerOptions", "create_app"]
