"""`mlx-spec generate` through the real Typer app on tiny models: piped output, --json
schema, stdin prompts, flag families, presets, errors; one run in a real pseudo-terminal
for the live panel."""

import sys

import pytest
from cli_support import (
    ESC,
    assert_one_line_error,
    assert_usage_error,
    has_ansi,
    invoke,
    invoke_json,
    terminal_env,
)
from rich.console import Console

from mlx_spec.apps.runner import Gamma
from mlx_spec.cli.render import View, bar, render_stats, summary_line
from mlx_spec.core.stats import Stats

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

STATS_KEYS = {
    "rounds", "drafted", "accepted", "generated", "target_forwards", "draft_forwards",
    "acceptance_rate", "acceptance_by_position", "mean_accepted_length", "decode_tps",
    "prefill_time", "peak_memory", "weight_bandwidth_bytes_per_s", "predicted_speedup",
    "measured_speedup", "gamma_now", "prefill_share",
}


def test_piped_text_on_stdout_summary_on_stderr(models):
    result = invoke(["generate", "Hello there", *models, "--max-tokens", "24", "--gamma", "2", "--raw"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip()  # the generated text
    assert not has_ansi(result.stdout) and not has_ansi(result.stderr)
    summary = result.stderr.strip().splitlines()[-1]
    assert "24 tok" in summary and "tok/s" in summary and "α̂" in summary and "γ 2" in summary


def test_json_schema(models):
    out = invoke_json(["generate", "Hello there", *models, "-n", "20", "--gamma", "3", "--raw"])
    assert set(out) >= {"text", "finish_reason", "prompt_tokens", "generated_tokens", "models",
                        "drafter", "gamma", "chat", "sampling", "stats"}
    assert out["finish_reason"] in ("stop", "length")
    assert out["prompt_tokens"] == len("Hello there") + 1  # byte tokens plus BOS
    assert out["drafter"] == "model" and out["gamma"] == 3 and out["chat"] is False
    assert out["models"]["target"].endswith("target") and out["models"]["draft"].endswith("draft")
    stats = out["stats"]
    assert STATS_KEYS <= set(stats)
    assert stats["generated"] == out["generated_tokens"] <= 20
    assert len(stats["acceptance_by_position"]) == 3
    assert 0 <= stats["acceptance_rate"] <= 1
    assert stats["draft_forwards"] > 0 and stats["weight_bandwidth_bytes_per_s"] > 0
    assert stats["predicted_speedup"] is None  # fixed γ: no cost model in play


def test_stdin_prompt_and_dash(models):
    a = invoke_json(["generate", *models, "-n", "8", "--raw"], input="Hello there")
    b = invoke_json(["generate", "-", *models, "-n", "8", "--raw"], input="Hello there")
    c = invoke_json(["generate", "Hello there", *models, "-n", "8", "--raw"])
    assert a["text"] == b["text"] == c["text"]


def test_chat_template_versus_raw(models):
    raw = invoke_json(["generate", "Hi", *models, "-n", "4", "--raw"])
    chat = invoke_json(["generate", "Hi", *models, "-n", "4", "--chat"])
    default = invoke_json(["generate", "Hi", *models, "-n", "4"])
    assert raw["prompt_tokens"] == 3 and not raw["chat"]
    assert chat["chat"] and chat["prompt_tokens"] > raw["prompt_tokens"]
    assert default["chat"]  # the tokenizer has a template


def test_greedy_output_identical_across_drafters_and_gamma(models):
    texts = {
        (drafter, gamma): invoke_json(["generate", "Hello", *models, "-n", "30", "--raw",
                                       "--drafter", drafter, "--gamma", gamma])["text"]
        for drafter, gamma in [("none", "0"), ("model", "1"), ("model", "4"), ("ngram", "3"), ("model", "auto")]
    }
    assert len(set(texts.values())) == 1


def test_drafter_none_and_auto_gamma(models):
    plain = invoke_json(["generate", "Hello", *models, "-n", "10", "--raw", "--drafter", "none"])
    assert plain["drafter"] == "none" and plain["gamma"] == 0
    assert plain["stats"]["drafted"] == 0 and plain["models"]["draft"] is None
    auto = invoke_json(["generate", "Hello", *models, "-n", "10", "--raw", "--gamma", "auto"])
    assert auto["gamma"] == "auto"
    assert auto["stats"]["predicted_speedup"] > 0
    # a measured speedup only once something was drafted (else it is timing noise)
    assert (auto["stats"]["measured_speedup"] is None) == (auto["stats"]["drafted"] == 0)


def test_suffix_without_a_draft_model_and_ngram_when_asked(tiny_dirs):
    target, _ = tiny_dirs
    out = invoke_json(["generate", "abcabcabcabc", "--model", target, "-n", "12", "--raw", "--gamma", "2"])
    assert out["drafter"] == "suffix" and out["stats"]["draft_forwards"] == 0
    ngram = invoke_json(["generate", "abcabcabcabc", "--model", target, "-n", "12", "--raw", "--gamma", "2",
                         "--drafter", "ngram"])
    assert ngram["drafter"] == "ngram" and ngram["text"] == out["text"]


def test_sampling_flags_and_seed(models):
    args = ["generate", "Hello", *models, "-n", "24", "--raw", "--gamma", "2", "--temp", "0.9",
            "--top-p", "0.95", "--top-k", "40", "--min-p", "0.02", "--repetition-penalty", "1.1"]
    a = invoke_json(args + ["--seed", "7"])
    b = invoke_json(args + ["--seed", "7"])
    assert a["sampling"] == {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.02,
                             "repetition_penalty": 1.1, "repetition_context": 64, "seed": 7}
    assert a["text"] == b["text"]


def test_stop_string_and_max_tokens(models):
    full = invoke_json(["generate", "Hello", *models, "-n", "40", "--raw", "--gamma", "2"])
    assert full["finish_reason"] == "length" and full["generated_tokens"] == 40
    text = full["text"]
    stop = text[12:14]
    cut = invoke_json(["generate", "Hello", *models, "-n", "40", "--raw", "--gamma", "2", "--stop", stop])
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.find(stop)]


def test_color_drafts_piped_has_no_escapes(models):
    result = invoke(["generate", "Hello", *models, "-n", "16", "--color-drafts"])
    assert result.exit_code == 0 and not has_ansi(result.stdout)


def test_preset_supplies_defaults_and_flags_override(models, tiny_dirs, monkeypatch):
    import mlx_spec.apps.runner as runner
    from mlx_spec.loading import Preset

    target, draft = tiny_dirs
    preset = Preset(name="tiny", target=target, draft=draft, drafter="model", gamma=2,
                    temperature=0.0, top_p=0.9, top_k=0, min_p=0.0, description="tiny test pair")
    real = runner.get_preset  # where the runner reads presets from
    monkeypatch.setattr(runner, "get_preset", lambda name: preset if name == "tiny" else real(name))
    out = invoke_json(["generate", "Hello", "--preset", "tiny", "-n", "8", "--raw"])
    assert out["models"] == {"target": target, "draft": draft, "preset": "tiny"}
    assert out["gamma"] == 2 and out["sampling"]["top_p"] == 0.9
    over = invoke_json(["generate", "Hello", "--preset", "tiny", "-n", "8", "--raw", "--gamma", "1",
                        "--top-p", "1.0", "--drafter", "ngram"])
    assert over["gamma"] == 1 and over["sampling"]["top_p"] == 1.0 and over["drafter"] == "ngram"
    assert over["models"]["draft"] is None  # ngram drafting: the draft model is not loaded


@pytest.mark.parametrize("args, fragment", [
    (["generate", "x", "--preset", "no-such-preset"], "no-such-preset"),
    (["generate", "x", "--gamma", "many"], "--gamma"),
    (["generate", "x", "--gamma", "99"], "--gamma"),
    (["generate", "x", "--drafter", "psychic"], "psychic"),
])
def test_errors_are_one_line(args, fragment):
    assert_usage_error(invoke(args), fragment)


def test_a_model_that_is_not_there_is_not_a_usage_error():
    assert_one_line_error(invoke(["generate", "x", "--model", "/no/such/model/dir"]), "/no/such/model/dir")


def test_error_paths_needing_models(models, tiny_dirs):
    target, _ = tiny_dirs
    assert_usage_error(invoke(["generate", "x", "--model", target, "--drafter", "model"]), "draft")
    assert_usage_error(invoke(["generate", *models], input="   \n"), "empty")
    assert_usage_error(invoke(["generate", "x", *models, "--temp", "0.5", "--top-p", "0"]), "--top-p")


def test_debug_flag_shows_the_traceback():
    result = invoke(["--debug", "generate", "x", "--gamma", "many"])
    assert result.exit_code != 0 and result.exception is not None
    assert not isinstance(result.exception, SystemExit)


def test_render_stats_is_a_pure_function_of_the_snapshot():
    stats = Stats()
    stats.observe_prefill(10, 10, 0.5)
    for accepted in (3, 1, 2, 3):
        stats.observe_round(3, accepted, accepted + 1, 0.01, 0.02)
    stats.peak_memory = 3 << 20
    view = View(stats=stats, drafter="model", gamma_mode=Gamma("auto"), gamma_now=3, bandwidth=2.5e9,
                predicted_speedup=1.8, measured_speedup=1.6, plain_tps=20.0)
    console = Console(record=True, width=160, file=open("/dev/null", "w"))
    console.print(render_stats(view))
    text = console.export_text()
    assert "auto (now 3)" in text and "position 3" in text and "2.50 GB/s" in text
    assert "│ 1.60× vs plain ≈ 20.0 tok/s from the cost curve (predicted 1.80× now, from the cost curve and this run's acceptance)" in text
    assert text.count("speedup") == 1  # the row's label, not said twice
    assert "3.0 MB" in text
    assert bar(1.0).strip() == "█" * 20 and bar(0.0).strip() == ""
    line = summary_line(view)
    assert not has_ansi(line) and "α̂ 0.75" in line and "by position 1.00 0.75 0.50" in line


def test_live_panel_in_a_terminal(tiny_dirs):
    pexpect = pytest.importorskip("pexpect")
    target, draft = tiny_dirs
    child = pexpect.spawn(sys.executable, ["-m", "mlx_spec.cli", "generate", "Hello", "--model", target,
                                           "--draft-model", draft, "-n", "60", "--gamma", "3",
                                           "--color-drafts", "--raw"],
                          encoding="utf-8", dimensions=(40, 100), timeout=60, env=terminal_env())
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    out = child.before
    assert "speculative decoding" in out and "position 3" in out and "tok/s" in out
    assert ESC + "[32m" in out  # accepted draft text coloured


def test_dtype_and_quantize_flags(models, tiny_dirs):
    target, _ = tiny_dirs
    q = invoke_json(["generate", "Hello", *models, "-n", "8", "--raw", "--gamma", "2",
                     "--quantize", "8", "--dtype", "bfloat16"])
    assert q["generated_tokens"] == 8
    # The target drafting for itself from its own 4-bit copy.
    d = invoke_json(["generate", "Hello", "--model", target, "--draft-model", target,
                     "--draft-quantize", "4", "-n", "8", "--raw", "--gamma", "2"])
    assert d["drafter"] == "model" and d["stats"]["drafted"] > 0
    assert_usage_error(invoke(["generate", "x", *models, "--dtype", "float64"]), "--dtype", "float64")


def test_quantization_group_size_flag(models, tiny_dirs):
    import mlx.nn as nn

    from mlx_spec.cli.common import ModelOptions, setup_models

    target, _ = tiny_dirs
    setup = setup_models(ModelOptions(model=target, drafter="none", quantize=4, group_size=32))
    quantized = [m for _, m in setup.pair.target.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized and {m.group_size for m in quantized} == {32}
    out = invoke_json(["generate", "Hello", *models, "-n", "4", "--raw", "--gamma", "2",
                       "--quantize", "8", "--q-group-size", "128"])
    assert out["generated_tokens"] == 4
    assert_usage_error(invoke(["generate", "x", *models, "--q-group-size", "32"]), "--quantize")
    assert_usage_error(invoke(["generate", "x", *models, "--quantize", "4", "--q-group-size", "48"]), "48")
