"""What `serve` says about its own state under load (issue 32): `/metrics` counts every
response, the 500s Starlette's outermost error middleware answers included, and a full
queue's 503 says in Retry-After how long the work ahead is likely to take, in both APIs.
Servers run in-process with the scripted model (`scripted_model.py`): mlx-lm's tokenizer and
template, the real engine and HTTP path."""

import math
import time

import anthropic
import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from scripted_model import END_OF_TURN_ID, EOS_ID, InProcessServer, ScriptedModel, save_tokenizer
from server_support import wait_for

from mlx_spec.core.engine import Engine
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.server import serving_openai as server_app

MODEL = "scripted"
HI = [{"role": "user", "content": "hi"}]
STEP_S = 0.1  # the paced model's time per forward pass


class PacedModel(ScriptedModel):
    """The scripted model at STEP_S a forward pass: with γ 0 an answer of n tokens takes
    about (n + 1) × STEP_S on the device, whatever else the machine does."""

    def __call__(self, inputs, cache=None):
        time.sleep(STEP_S)
        return super().__call__(inputs, cache)


def serve(tmp_path, model=None, **options) -> tuple[InProcessServer, object]:
    tokenizer = load_tokenizer(save_tokenizer(tmp_path), eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    model = model or ScriptedModel()
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    app = create_app(engine, tokenizer, ServerOptions(model_name=MODEL, gamma="0", context_length=4096,
                                                      **options))
    return InProcessServer(app), tokenizer


def responses_with(server: InProcessServer, code: str) -> float:
    text = httpx.get(server.base.removesuffix("/v1") + "/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "mlx_spec_http_responses")
    return sum(s.value for s in family.samples if s.labels.get("code") == code and s.name.endswith("_total"))


def test_metrics_count_the_500s_starlette_answers(tmp_path, monkeypatch):
    """An exception that leaves a route is answered 500 by Starlette's ServerErrorMiddleware,
    outside every added middleware: three such 500s on a fresh server read as 0 before."""
    def broken(raw, model):
        raise RuntimeError("a bug in the route")

    monkeypatch.setattr(server_app, "parse_body", broken)
    server, _ = serve(tmp_path)
    try:
        for path in ("/chat/completions", "/completions", "/chat/completions"):
            response = httpx.post(server.base + path, json={"model": MODEL, "messages": HI}, timeout=10)
            assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
        assert responses_with(server, "500") == 3
        assert httpx.get(server.base + "/models", timeout=10).status_code == 200
        assert responses_with(server, "200") >= 1  # the others are still counted
    finally:
        server.stop()


def test_retry_after_reflects_the_queue_and_recent_jobs(tmp_path):
    """A full queue's 503 estimated one second of wait from a mean that started at 1 s and
    moved a fifth of the way per job, while each answer ran for seconds. Now: the median of
    recent jobs' device time for the running job and each one waiting, here (2 + 1) × one
    answer's time, in OpenAI's error and in Anthropic's `overloaded_error` alike."""
    model = PacedModel()
    tokenizer = load_tokenizer(save_tokenizer(tmp_path), eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    model.script = tokenizer.encode("a" * 24, add_special_tokens=False)  # ~2.5 s an answer
    server, _ = serve(tmp_path, model, queue_size=2)
    streams = []
    try:
        began = time.monotonic()
        first = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=40)
        answer_s = time.monotonic() - began  # the device's time, plus the HTTP round trip
        assert first.choices[0].message.content == "a" * 24

        def open_stream():
            client = httpx.Client(timeout=30)
            request = client.build_request("POST", server.base + "/chat/completions", json={
                "model": MODEL, "messages": HI, "max_tokens": 40, "stream": True})
            response = client.send(request, stream=True)
            assert response.status_code == 200  # queued before the headers are sent
            streams.append((client, response))

        def health():
            return httpx.get(server.base.removesuffix("/v1") + "/health", timeout=10).json()

        open_stream()
        wait_for(lambda: health()["busy"], 10, "generating")
        open_stream()
        open_stream()
        assert health()["queued"] == 2
        expected = (math.ceil(3 * 0.8 * answer_s), math.ceil(3 * answer_s))  # 2 waiting + the running one
        with pytest.raises(openai.InternalServerError) as error:
            server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=40)
        assert error.value.status_code == 503 and error.value.body["code"] == "server_busy"
        assert expected[0] <= int(error.value.response.headers["retry-after"]) <= expected[1]
        claude = anthropic.Anthropic(base_url=server.base.removesuffix("/v1"), api_key="unused", max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as error:
            claude.messages.create(model=MODEL, max_tokens=40, messages=HI)
        assert error.value.status_code == 503 and error.value.body["error"]["type"] == "overloaded_error"
        assert expected[0] <= int(error.value.response.headers["retry-after"]) <= expected[1]
    finally:
        for client, response in streams:
            response.close()
            client.close()
        server.stop()
