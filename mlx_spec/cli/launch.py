"""`mlx-spec launch claude|codex|opencode`: an agent on a local model in one command, as
`ollama launch claude` is for Ollama's users.

A server already answering `/health` at `--port` is used as it is; otherwise `mlx-spec serve`
starts there (with `-m` and `--api-key`) and stops when the client exits. The client runs
with its base URL, key and model set for it, nothing to configure by hand:

- claude (Claude Code): ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY;
- codex (Codex CLI): a `mlxspec` model provider given with `-c` (the Responses API);
- opencode: a config file naming an OpenAI-compatible `mlxspec` provider (OPENCODE_CONFIG).

Arguments after `--` go to the client (`mlx-spec launch claude -- -p "say hi"`); its exit
status is this command's. A client that is not installed is a one-line error naming its
npm package.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from mlx_spec.cli.app import app
from mlx_spec.errors import MlxSpecError, UsageError

NPM_PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai"}
DEFAULT_KEY = "mlx-spec"  # what a client sends when the server takes any key
START_TIMEOUT_S = 900.0  # loading (and first converting) a model can take minutes


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    client: Annotated[str, typer.Argument(metavar="claude|codex|opencode", help="The agent to run.")],
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="The model to serve (as `serve -m`); default: serve's default.")] = None,
    port: Annotated[int, typer.Option(
        "--port", "-p", min=0, max=65535,
        help="Where the server is, or is started; 0 picks a free port.")] = 8080,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="MLX_SPEC_API_KEY",
        help="The key the client sends (and a server started here requires).")] = None,
) -> None:
    """Run Claude Code, Codex or opencode on a local model: starts (or reuses) a server and
    runs the client with its base URL, key and model set. Arguments after `--` go to it."""
    if client not in NPM_PACKAGES:
        raise UsageError(f"unknown client {client!r}: use claude, codex or opencode", flag="CLIENT")
    binary = shutil.which(client)
    if binary is None:
        raise MlxSpecError(f"{client} is not installed: npm install -g {NPM_PACKAGES[client]}")
    port = port or _free_port()
    base = f"http://127.0.0.1:{port}"
    key = api_key or DEFAULT_KEY
    server = None
    health = _health(base)
    if health is None:
        server = _start_server(model, port, api_key)
        health = _wait_healthy(base, server)
    print(f"mlx-spec launch: {client} on {health.get('model')!r} at {base}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="mlx-spec-launch-") as scratch:
        env, args = client_setup(client, base, key, health.get("model") or "local", Path(scratch))
        try:
            code = subprocess.call([binary, *args, *ctx.args], env={**os.environ, **env})
        finally:
            if server is not None:
                server.terminate()
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    server.kill()
    raise typer.Exit(code)


def client_setup(client: str, base: str, key: str, model: str, scratch: Path) -> tuple[dict, list[str]]:
    """(environment, arguments) that point `client` at the server at `base`."""
    if client == "claude":
        return {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": key}, []
    if client == "codex":
        provider = {"name": "mlx-spec", "base_url": f"{base}/v1", "env_key": "MLX_SPEC_API_KEY",
                    "wire_api": "responses"}
        overrides = [f"model_providers.mlxspec.{k}={json.dumps(v)}" for k, v in provider.items()]
        args = [a for o in ['model_provider="mlxspec"', *overrides] for a in ("-c", o)]
        return {"MLX_SPEC_API_KEY": key}, [*args, "-m", model]
    config = {"$schema": "https://opencode.ai/config.json", "model": f"mlxspec/{model}",
              "provider": {"mlxspec": {"npm": "@ai-sdk/openai-compatible", "name": "mlx-spec",
                                       "options": {"baseURL": f"{base}/v1", "apiKey": key},
                                       "models": {model: {"name": model}}}}}
    path = scratch / "opencode.json"
    path.write_text(json.dumps(config))
    return {"OPENCODE_CONFIG": str(path)}, []


def _health(base: str) -> Optional[dict]:
    try:
        import httpx  # here: `mlx-spec --help` should not import an HTTP client

        response = httpx.get(base + "/health", timeout=2)
    except httpx.TransportError:
        return None
    return response.json() if response.status_code == 200 else None


def _start_server(model: Optional[str], port: int, api_key: Optional[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "mlx_spec.cli", "serve", "--port", str(port)]
    command += ["--model", model] if model else []
    command += ["--api-key", api_key] if api_key else []
    return subprocess.Popen(command)


def _wait_healthy(base: str, server: subprocess.Popen) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise MlxSpecError(f"the server did not start (exit status {server.returncode}); its error is above")
        health = _health(base)
        if health is not None:
            return health
        time.sleep(0.25)
    server.terminate()
    raise MlxSpecError(f"the server did not answer at {base} within {START_TIMEOUT_S:.0f} s")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
