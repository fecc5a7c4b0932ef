"""`mlx-spec launch claude|codex|opencode` (issue 42, item 10): a server started (or reused) on
the model, the client run with its base URL, key and model set, its exit status passed on,
the server stopped after it; a client that is not installed is a one-line error naming its
npm package. The client here is a small program standing in for Claude Code (what it does
with the variables it is given is what is checked: a request to the server); the real
Claude Code through `launch` is in tests/test_agents_claude_code.py."""

import json
import os
import subprocess
import sys
import textwrap

import httpx

from cli_support import assert_one_line_error, assert_usage_error, invoke
from mlx_spec.cli.launch import client_setup

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache

# Sends one message to the server it was pointed at, writes what it saw, exits 3.
STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    import httpx
    base, key = os.environ["ANTHROPIC_BASE_URL"], os.environ["ANTHROPIC_API_KEY"]
    answer = httpx.post(base + "/v1/messages", headers={{"x-api-key": key}}, timeout=120, json={{
        "model": "claude-opus-4-8", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi"}}]}})
    json.dump({{"base": base, "key": key, "args": sys.argv[1:], "status": answer.status_code,
               "model": answer.json().get("model")}}, open(os.environ["STAND_IN_OUT"], "w"))
    sys.exit(3)
    """)


def test_a_client_that_is_not_installed_names_its_npm_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert_one_line_error(invoke(["launch", "opencode"]), "opencode is not installed", "npm install -g opencode-ai")
    assert_usage_error(invoke(["launch", "cursor"]), "unknown client 'cursor'")


def test_launch_serves_the_model_and_runs_the_client_on_it(tmp_path, tiny_dirs, private_cost_cache):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "claude"
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    out = tmp_path / "seen.json"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STAND_IN_OUT": str(out),
           "MLX_SPEC_DEBUG": ""}
    port = _free_port()
    run = subprocess.run([sys.executable, "-m", "mlx_spec.cli", "launch", "claude", "-m", tiny_dirs[0],
                          "--port", str(port), "--api-key", "sekret", "--", "-p", "say hi"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 3, run.stderr[-3000:]  # the client's own
    seen = json.loads(out.read_text())
    assert seen == {"base": f"http://127.0.0.1:{port}", "key": "sekret", "args": ["-p", "say hi"],
                    "status": 200, "model": tiny_dirs[0]}
    try:  # the server it started is gone
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the server is still running")
    except httpx.TransportError:
        pass
    assert "Traceback" not in run.stderr


def test_each_client_is_pointed_at_the_server(tmp_path):
    base = "http://127.0.0.1:8080"
    assert client_setup("claude", base, "k", "m", tmp_path) == (
        {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "k"}, [])
    env, args = client_setup("opencode", base, "k", "gemma", tmp_path)
    config = json.loads(open(env["OPENCODE_CONFIG"]).read())
    assert config["model"] == "mlxspec/gemma" and args == []
    assert config["provider"]["mlxspec"]["options"] == {"baseURL": base + "/v1", "apiKey": "k"}
    env, args = client_setup("codex", base, "k", "gemma", tmp_path)
    assert env == {"MLX_SPEC_API_KEY": "k"} and args[-2:] == ["-m", "gemma"]
    assert 'model_providers.mlxspec.base_url="http://127.0.0.1:8080/v1"' in args
    assert 'model_providers.mlxspec.wire_api="responses"' in args


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
