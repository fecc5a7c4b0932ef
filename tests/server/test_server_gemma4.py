"""`mlx-spec serve` on a Gemma 4 target, as a user starts it: every drafter (none, n-gram, a
draft model, the MTP assistant), γ fixed and auto, a first start (which calibrates) and a
start that finds the calibration cached. Each answers a chat turn, a completion (streamed
and not) and an Anthropic message, and the greedy completion equals mlx-lm's own `load` +
`generate` of the same prompt.

The models load on the main thread and run on the worker thread: an array the loader left
lazy (mlx-lm's Gemma 4 keeps its RoPE frequencies as a private `rope._freqs`) failed every
request with "There is no Stream(cpu, 0) in current thread"."""

import json
import threading

import httpx
import pytest
from mlx_lm import generate, load
from server_support import Server, server_env

from mlx_spec.apps.runner import build_engine
from mlx_spec.core.policy import FixedGamma
from mlx_spec.loading import load_pair

PROMPT = "one two one two one two"
TOKENS = 12


pytest_plugins = ["cli_fixtures"]  # fixtures: gemma4_dirs


@pytest.fixture(scope="module")
def mlx_lm_answer(gemma4_dirs):
    """mlx-lm's greedy completion of PROMPT, loaded and decoded by mlx-lm alone."""
    model, tokenizer = load(str(gemma4_dirs / "target"))
    return generate(model, tokenizer, tokenizer.encode(PROMPT), max_tokens=TOKENS)


def _on_a_new_thread(fn):
    """fn() on a thread that did not make the model's arrays; its error is raised here."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001  (handed back to the test)
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "mtp"])
def test_loaded_models_decode_on_another_thread(gemma4_dirs, drafter):
    """The server's split, without the server: load on this thread, decode on another."""
    draft = {"model": "draft", "mtp": "assistant"}.get(drafter)
    pair = load_pair(str(gemma4_dirs / "target"), draft and str(gemma4_dirs / draft), dtype="float32",
                     progress=False)
    engine = build_engine(pair, drafter)
    rounds = _on_a_new_thread(lambda: list(engine.rounds([2, 40, 41, 40, 41], gamma=FixedGamma(2),
                                                         max_tokens=TOKENS)))
    assert sum(len(r.tokens) for r in rounds) == TOKENS


def _answers(server: Server) -> str:
    """Ask the four kinds of request; return the greedy completion's text."""
    model = server.client().models.list().data[0].id
    client = server.client()
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    message = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi hi"}]},
        headers={"anthropic-version": "2023-06-01"})
    assert message.status_code == 200, message.text
    assert message.json()["type"] == "message"
    return whole.choices[0].text


CASES = {  # name: (flags beyond --model, whether γ is auto)
    "plain": (["--drafter", "none"], False),
    "ngram-3": (["--drafter", "ngram", "--gamma", "3"], False),
    "ngram-auto": (["--drafter", "ngram", "--gamma", "auto"], True),
    "draft-model-2": (["-d", "{draft}", "--gamma", "2"], False),
    "draft-model-auto": (["-d", "{draft}", "--gamma", "auto"], True),
    "mtp-2": (["-d", "{assistant}", "--gamma", "2"], False),
    "mtp-auto": (["-d", "{assistant}", "--gamma", "auto"], True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_serve_answers_on_gemma4_with_every_drafter(case, gemma4_dirs, mlx_lm_answer, tmp_path):
    flags, auto = CASES[case]
    flags = [f.format(draft=gemma4_dirs / "draft", assistant=gemma4_dirs / "assistant") for f in flags]
    env = server_env(tmp_path / "costs")
    starts = ("first start", "calibration cached") if auto else ("first start",)
    for start in starts:
        server = Server(["--model", gemma4_dirs / "target", *flags], env)
        try:
            assert _answers(server) == mlx_lm_answer, start
            health = server.health()
            assert health["failed"] == 0, (start, health)
        finally:
            server.stop()
        assert "Traceback" not in server.log and "Stream(" not in server.log, (start, server.log)
    if auto:  # the second start read the curve the first one measured
        assert json.loads((tmp_path / "costs" / "costs.json").read_text())
