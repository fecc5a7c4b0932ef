"""A new user's first runs and bad input, through the real CLI (issue 10): checks that need
no model happen before one loads, bad bytes and over-long prompts are one line, numbers
that would mislead are not shown."""

import json

import pytest
from cli_support import assert_one_line_error, assert_usage_error, invoke

from mlx_spec.apps.runner import Gamma
from mlx_spec.cli.render import View, summary_line
from mlx_spec.core.stats import Stats

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")


@pytest.fixture
def no_loading(monkeypatch):
    """Loading any model fails the test: the error must come first."""
    import mlx_spec.loading.pairing as pairing

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(pairing, "load_model", load_model)


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
@pytest.mark.parametrize("flags,fragment", [
    (["--seed", "-1"], "seed must be between 0 and 2^64 - 1"),
    (["--seed", "99999999999999999999"], "seed must be between 0 and 2^64 - 1"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--min-p", "1"], "min-p must be in [0, 1)"),
    (["-d", "/nonexistent"], "draft model: no such file or folder: /nonexistent"),
    (["--gamma", "99"], "must be between"),  # bench: "γ in a sweep ... between 1 and 16"
])
def test_flags_are_checked_before_any_model_loads(tiny_dirs, no_loading, command, flags, fragment):
    if command == "bench" and flags[0] in ("--top-p", "--min-p"):
        pytest.skip("bench has no such flag")
    prompt = ["Hello"] if command == "generate" else []
    result = invoke([command, *prompt, "-m", tiny_dirs[0], *flags], input="")
    if flags[0] == "-d":  # a path that is not there is about the world: exit 1
        assert_one_line_error(result, fragment)
    else:  # a value our checks refuse is a usage error: exit 2
        assert_usage_error(result, fragment)


def test_top_p_help_says_what_is_accepted():
    result = invoke(["generate", "--help"])
    assert "(0,1]" in result.stdout and "0.0<=x<=1.0" not in result.stdout


def test_a_missing_target_is_named_before_loading(no_loading):
    result = invoke(["generate", "Hello", "-m", "./no/such/model"])
    assert_one_line_error(result, "target model: no such file or folder: ./no/such/model")


@pytest.mark.parametrize("how", ["stdin", "argument"])
def test_bytes_that_are_not_utf8_become_replacement_characters(models, how):
    if how == "stdin":  # printf '\xff\xfe abc' | mlx-spec generate
        result = invoke(["generate", *models, "-n", "4", "--raw", "--json"], input=b"\xff\xfe abc")
    else:  # Python hands undecodable argv bytes over as lone surrogates
        result = invoke(["generate", "\udcff\udcfe abc", *models, "-n", "4", "--raw", "--json"])
    assert result.exit_code == 0, result.stderr
    assert "the prompt had 2 bytes that are not valid UTF-8; each became U+FFFD" in result.stderr
    assert json.loads(result.stdout)["generated_tokens"] == 4


def test_chat_and_bench_take_bad_bytes_too(models, tmp_path):
    result = invoke(["chat", *models, "-n", "4"], input=b"\xff hi\n/quit\n")
    assert result.exit_code == 0, result.stderr
    assert "your message had 1 byte that is not valid UTF-8" in result.stderr
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    result = invoke(["bench", *models, "--prompt", f"@{bad}", "--runs", "1", "-n", "4", "--gamma", "1"])
    assert result.exit_code == 0, result.stderr
    assert "prompt 'bad.txt' had 1 byte that is not valid UTF-8" in result.stderr


def test_a_prompt_longer_than_the_context_is_refused_up_front(models, monkeypatch):
    """The tiny models take 4096 positions; a 5000-token prompt is refused before prefill."""
    import mlx_spec.cache.sequence as cache

    def prefill(*args, **kwargs):
        raise AssertionError("prefill started")

    monkeypatch.setattr(cache.SequenceCache, "prefill", prefill)
    result = invoke(["generate", *models, "--raw"], input="x" * 5000)
    assert_one_line_error(result, "the prompt is 5,001 tokens, but the model's context is 4,096 tokens")


def test_prefill_progress_starts_before_the_first_chunk(tiny_target):
    from mlx_spec.core.engine import Engine

    calls = []
    engine = Engine(tiny_target, prefill_chunk=16)
    list(engine.rounds(list(range(10, 50)), gamma=0, max_tokens=1, prefill_progress=lambda *a: calls.append(a)))
    assert calls == [(0, 39), (16, 39), (32, 39), (39, 39)]


def test_speedup_is_shown_only_when_something_was_drafted(models):
    """γ = auto parked at 0 (this pair on this CPU, like the default preset) used to print a
    'speedup' that was timing noise against the calibration's estimate."""
    result = invoke(["generate", "Hello there", *models, "-n", "24", "--gamma", "auto", "--raw", "--json"])
    assert result.exit_code == 0, result.stderr
    stats = json.loads(result.stdout)["stats"]
    assert (stats["measured_speedup"] is None) == (stats["drafted"] == 0)
    parked = View(Stats(rounds=3, generated=3, decode_time=1.0), "ngram", Gamma("auto"), 0, 1e9,
                  predicted_speedup=1.0, measured_speedup=None, plain_tps=3.0)
    assert "speedup" not in summary_line(parked)
    drafting = View(Stats(rounds=3, drafted=6, accepted=4, generated=7, decode_time=1.0), "ngram", Gamma("auto"), 2,
                    1e9, predicted_speedup=2.1, measured_speedup=7 / 3.0, plain_tps=3.0)
    assert "speedup 2.33× vs plain ≈ 3.0 tok/s from the cost curve (predicted 2.10× now, from the cost curve and this run's acceptance)" in summary_line(drafting)


def test_an_interrupted_run_says_so(models, monkeypatch):
    import mlx_spec.cli.generate as generate

    real = generate.stream_generate

    def interrupted_after_one(*args, **kwargs):
        for i, response in enumerate(real(*args, **kwargs)):
            if i == 1:
                raise KeyboardInterrupt
            yield response

    monkeypatch.setattr(generate, "stream_generate", interrupted_after_one)
    result = invoke(["generate", "Hello there", *models, "-n", "24", "--gamma", "2", "--raw"])
    assert result.exit_code == 130
    assert result.stderr.strip().splitlines()[-1].startswith("interrupted · ")
    out = invoke(["generate", "Hello there", *models, "-n", "24", "--gamma", "2", "--raw", "--json"])
    assert out.exit_code == 130 and json.loads(out.stdout)["finish_reason"] == "interrupted"


def test_slow_steps_print_a_line_each_when_stderr_is_not_a_terminal(models, tmp_path, monkeypatch):
    """Piped, calibration used to print nothing for seconds."""
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))  # not calibrated yet
    result = invoke(["generate", "Hello there", *models, "-n", "4", "--gamma", "auto", "--raw"])
    assert result.exit_code == 0, result.stderr
    assert "calibrating the cost curve for γ = auto" in result.stderr.splitlines()[0]


def test_recalibrate_measures_the_cost_curve_again_and_caches_it(models, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    args = ["generate", "Hello there", *models, "-n", "4", "--gamma", "auto", "--raw"]

    def run(*extra):
        result = invoke(args + list(extra))
        assert result.exit_code == 0, result.stderr
        entries = json.loads((tmp_path / "costs.json").read_text())
        return "calibrating the cost curve" in result.stderr, [e["measured_at"] for e in entries.values()]

    calibrated, first = run()
    assert calibrated and len(first) == 1
    assert run() == (False, first)  # cached
    calibrated, again = run("--recalibrate")
    assert calibrated and len(again) == 1 and again[0] > first[0]  # measured anew, replacing it
    assert run() == (False, again)  # and the flag did not outlive its command
