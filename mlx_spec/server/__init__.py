"""`mlx-spec serve`: an OpenAI- and Anthropic-compatible HTTP server over one engine.

    app = create_app(engine, tokenizer, ServerOptions(model_name="default"))
    uvicorn.run(app, host="127.0.0.1", port=8080)

`guards` checks every request first (Host, API key, content type, body size). Each API is
a serving class on one base (`serving.Serving`: read and check the body, tokenize the
prompt, queue the job, collect the answer): `serving_openai` (chat completions,
completions), `serving_anthropic` (messages), `serving_responses` (OpenAI's Responses
API, with `responses_store` for stored responses); `app` builds them and mounts their routes.
The wire format: `body_bounds` (what a body may hold, checked on its bytes),
`request_base`, `openai_requests`, `anthropic_requests` and `responses_requests` (request
models), `openai_responses`, `anthropic_responses`, `responses_output` and `logprobs`
(answers), `api_error` (errors).
`worker` is the single generation thread with its bounded queue and long-lived caches
(`caches`, `disk_caches`: several conversations at once); `prompt` renders chat templates,
`tools` tool calls (mlx-lm's parsers), `images` image parts, `metrics` `GET /metrics`.
"""

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.app import create_app
from mlx_spec.server.options import ServerOptions

__all__ = ["ApiError", "ServerOptions", "create_app"]
