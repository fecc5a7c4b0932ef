"""`serve --keep-alive` and a request's `keep_alive` (Ollama's): the models leave memory
after the idle period, /health and /v1/models say so, and the next request loads them again
and answers exactly as before; bad durations are refused in one line."""

import math
import subprocess
import sys

import anthropic
import httpx
import pytest
from mlx_lm import generate, load
from server_support import (
    anthropic_error,
    assert_openai_error,
    server_env,
    server_rss_mib,
    serving,
    wait_for,
)

from mlx_spec.server.worker import FOREVER, keep_alive_seconds
from mlx_spec.testing.tiny import save_tiny_model, tiny_gemma3

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache

PROMPT = "The keeper of the lighthouse"
# A wide MLP makes the weights (~200 MiB in float32) dominate what loading adds to RSS,
# which for the tiny models is mostly Python's and MLX's own libraries.
WIDE = dict(intermediate_size=65536)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "target"
    save_tiny_model(path, tiny_gemma3(seed=3, **WIDE))
    return str(path)


def _weights_mib(path) -> float:
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20


def _complete(server, model, **extra):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **extra}
    response = httpx.post(server.base + "/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["text"], answer["mlx_spec"]


def _models_loaded(server) -> list[bool]:
    return [m["loaded"] for m in httpx.get(server.base + "/models", timeout=10).json()["data"]]


@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("1h30m", 5400.0), ("500ms", 0.5),
    ("300", 300.0), (300, 300.0), (2.5, 2.5), (0, 0.0), ("0", 0.0), ("0s", 0.0),
    (-1, FOREVER), ("-1", FOREVER), ("-5m", FOREVER), ("forever", FOREVER)])
def test_durations_read_as_ollama_reads_them(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["", "soon", "5 minutes", "5x", "m", "1.2.3s", "nan", True, [1]])
def test_bad_durations_are_refused(value):
    with pytest.raises(ValueError) as error:
        keep_alive_seconds(value)
    assert "\n" not in str(error.value)


def test_idle_server_frees_the_weights_and_reloads_exactly(wide_dir, cost_cache):
    expected = generate(*load(wide_dir), PROMPT, max_tokens=16)
    for server in serving(["--model", wide_dir, "--keep-alive", "1s"], server_env(cost_cache)):
        text, stats = _complete(server, wide_dir)
        assert text == expected and stats["loaded"] is False
        loaded_rss = server_rss_mib(server)
        wait_for(lambda: not server.health()["loaded"], 30, "unloaded")
        assert _models_loaded(server) == [False]
        freed = loaded_rss - server_rss_mib(server)
        weights = _weights_mib(wide_dir)
        assert freed >= 0.9 * weights, (freed, weights)
        text, stats = _complete(server, wide_dir)
        assert text == expected
        assert stats["loaded"] is True and stats["load_seconds"] > 0
        assert server.health()["loaded"] and _models_loaded(server) == [True]
        assert "calibrating" not in server.log.split("at http://")[-1]  # no recalibration


@pytest.fixture(scope="module")
def server(tiny_dirs, cost_cache):
    target, draft = tiny_dirs
    yield from serving(["--model", target, "--draft-model", draft, "--gamma", "2"],
                       server_env(cost_cache))


def test_a_request_keep_alive_of_zero_unloads_after_its_answer(server, tiny_dirs):
    model = tiny_dirs[0]
    first, _ = _complete(server, model)
    assert server.health()["loaded"]
    text, stats = _complete(server, model, keep_alive=0)
    assert text == first and stats["loaded"] is False
    wait_for(lambda: not server.health()["loaded"], 10, "unloaded")
    text, stats = _complete(server, model)  # the server's own keep-alive again: forever
    assert text == first and stats["loaded"] is True
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    message = client.messages.create(model=model, max_tokens=8,
                                     messages=[{"role": "user", "content": "hi"}],
                                     extra_body={"keep_alive": "0s"})
    assert message.model_extra["mlx_spec"]["loaded"] is False
    wait_for(lambda: not server.health()["loaded"], 10, "unloaded")
    answer = server.client().chat.completions.create(
        model=model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "hi"}],
        extra_body={"keep_alive": "5m"})
    assert answer.model_extra["mlx_spec"]["loaded"] is True
    assert server.health()["loaded"]


def test_bad_keep_alive_is_a_400(server, tiny_dirs):
    model = tiny_dirs[0]
    response = server.post("/completions", {"model": model, "prompt": "x", "keep_alive": "soon"})
    assert_openai_error(response, 400, "keep_alive")
    response = server.post("/chat/completions", {"model": model, "keep_alive": True,
                                                 "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400, response.text
    response = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": model, "max_tokens": 4, "keep_alive": "5 minutes",
        "messages": [{"role": "user", "content": "x"}]})
    assert "keep_alive" in anthropic_error(response, 400, "invalid_request_error")
    assert server.health()["loaded"]


def test_bad_keep_alive_flag_is_a_one_line_error(tiny_dirs, cost_cache):
    result = subprocess.run([sys.executable, "-m", "mlx_spec.cli", "serve", "--model", tiny_dirs[0],
                             "--keep-alive", "soon"], capture_output=True, text=True, timeout=60,
                            env={**__import__("os").environ, **server_env(cost_cache)})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--keep-alive" in lines[0], result.stderr
