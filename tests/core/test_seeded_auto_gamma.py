"""A seed reproduces a sampled answer under γ auto, however busy the machine is.

Auto γ used to follow each round's wall-clock time (`cost_model.LiveCosts`), and each round
splits the sampling key, so the same seed drew different text when rounds took different
times. Here the clock is perturbed (random jumps between readings, a new pattern per run)
in `mlx-spec generate` (in-process) and in a `mlx-spec serve` subprocess (a sitecustomize
on its path), and seeded answers must not change. Unseeded runs still learn costs."""

import os
import random
import textwrap
import time

import pytest
from cli_support import invoke_json
from server_support import Server, server_env

from mlx_spec.apps.runner import build_engine, gamma_policy
from mlx_spec.core import engine as engine_module
from mlx_spec.core.cost_model import LiveCosts
from mlx_spec.loading import load_pair

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

# The n-gram drafter on a repeating prompt: drafting pays at some γ, so auto γ has choices
# to make (with the tiny draft model, as dear as the target, it would only park).
PROMPT = "one two three one two three one two three one two three"
SAMPLING = ["--temp", "0.7", "--seed", "11", "-n", "48", "--gamma", "auto", "--drafter", "ngram", "--raw"]


def jittery_clock(seed: int):
    """A monotonic clock that runs 10x slow to 10x fast, at random between readings: each
    round measures its real time scaled by a random factor, as on a machine whose load
    comes and goes."""
    rng, real = random.Random(seed), time.perf_counter
    state = {"real": real(), "shown": 0.0}

    def perf_counter():
        now = real()
        state["shown"] += (now - state["real"]) * 10 ** rng.uniform(-1, 1)
        state["real"] = now
        return state["shown"]

    return perf_counter


def test_seeded_generate_is_the_same_under_any_clock(tiny_dirs, monkeypatch):
    answers = set()
    for clock in range(4):
        monkeypatch.setattr(engine_module, "perf_counter", jittery_clock(clock))
        answers.add(invoke_json(["generate", PROMPT, *SAMPLING, "--model", tiny_dirs[0]])["text"])
    assert len(answers) == 1, answers


def test_only_an_unseeded_policy_learns_from_the_clock(tiny_dirs):
    pair = load_pair(*tiny_dirs, dtype="float32", progress=False)
    engine = build_engine(pair, "model")
    for gamma in ("auto", "tree"):
        assert isinstance(gamma_policy(gamma, engine).costs, LiveCosts)
        assert not isinstance(gamma_policy(gamma, engine, reproducible=True).costs, LiveCosts)


SITECUSTOMIZE = textwrap.dedent('''
    import random, time
    _real, _rng, _state = time.perf_counter, random.Random(), {"real": time.perf_counter(), "shown": 0.0}
    def _jittery():  # as jittery_clock, seeded from the OS
        now = _real()
        _state["shown"] += (now - _state["real"]) * 10 ** _rng.uniform(-1, 1)
        _state["real"] = now
        return _state["shown"]
    time.perf_counter = _jittery
''')


def test_seeded_requests_are_the_same_under_any_clock(tiny_dirs, cost_cache, tmp_path):
    """Each request builds its own auto γ policy; the server's clock jumps at random, so on
    a learning policy every request would see other round times."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    target = tiny_dirs[0]
    server = Server(["--model", target, "--drafter", "ngram", "--gamma", "auto"],
                    {**server_env(cost_cache), "PYTHONPATH": path})
    try:
        client = server.client()
        answers = {client.completions.create(model=target, prompt=PROMPT, max_tokens=48, temperature=0.7,
                                             seed=11).choices[0].text for _ in range(4)}
    finally:
        server.stop()
    assert "Traceback" not in server.log, server.log
    cli = invoke_json(["generate", PROMPT, *SAMPLING, "--model", target])
    assert answers == {cli["text"]}
