"""`mlx-spec bench` and the sweep library: formulas, the md5 identity check (including an
injected mismatch that must fail loudly), table / JSON / CSV / plot outputs, temperature
re-runs, committed prompts."""

import csv
import json
import re

import pytest
from cli_support import assert_one_line_error, assert_usage_error, has_ansi, invoke, invoke_json

from mlx_spec.apps import sweep
from mlx_spec.apps.sweep import SettingSummary
from mlx_spec.cli.bench import parse_gammas, recommendation_text
from mlx_spec.core.policy import cost_model_speedup, theorem_speedup
from mlx_spec.errors import MlxSpecError
from mlx_spec.prompts import committed_prompts, resolve_prompt

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

FAST = ["--prompt", "Hello there", "--runs", "1", "--max-tokens", "12"]


# -- library -----------------------------------------------------------------------------


def test_theorem_3_8():
    # The paper's example: α = 0.8, γ = 5 gives 3.69× at c = 0.
    assert theorem_speedup(0.8, 5, 0.0) == pytest.approx(3.69, abs=0.005)
    assert theorem_speedup(0.8, 5, 0.05) == pytest.approx(3.69 / 1.25, abs=0.005)
    assert theorem_speedup(1.0, 3, 0.0) == 4.0
    assert theorem_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
    assert theorem_speedup(0.9, 0, 0.5) == 1.0


def test_cost_model_speedup_uses_the_verify_curve():
    from mlx_spec.core.cost_model import CostCurve

    flat = CostCurve(verify=[1.0] * 8, draft_step=0.0, context=256)
    assert cost_model_speedup(flat, [0.5, 0.5], 2) == pytest.approx(1.75)
    linear = CostCurve(verify=[float(w) for w in range(1, 9)], draft_step=0.0, context=256)
    assert cost_model_speedup(linear, [1.0, 1.0], 2) == pytest.approx(1.0)
    assert cost_model_speedup(flat, [0.5], 1.5) == pytest.approx((1.5 + 1.75) / 2)


def test_identity_helpers_and_gamma_parsing():
    assert sweep.token_md5([1, 2, 3]) == sweep.token_md5([1, 2, 3]) != sweep.token_md5([1, 2, 4])
    assert sweep.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert sweep.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert sweep.first_difference([1, 2], [1, 2, 3]) == 2
    assert parse_gammas(["1,2", "3", "auto", "2"]) == [1, 2, 3, "auto"]
    for bad in (["x"], ["0"], ["17"], [""]):
        with pytest.raises(MlxSpecError):
            parse_gammas(bad)


def _summary(setting, speedup, identical=True, prompt="p"):
    return SettingSummary(prompt, setting, 0, 1, 10.0, 10.0, 10.0, 0.0, speedup, 10.0, 0.1, 0.5, [], [],
                          1.0, 0.0, 0.1, 0.1, 1.0, 1.0, 0.0, 0, 10, "", identical, None)


def test_recommendation_prefers_fastest_exact_setting():
    rows = [_summary("off", 1.0), _summary("γ=1", 1.3), _summary("γ=3", 1.6, identical=False),
            _summary("γ=2", 1.5)]
    assert sweep.recommend(rows) == ("γ=2", 1.5)
    assert sweep.recommend([_summary("off", 1.0), _summary("γ=1", 0.8)])[0] == "off"
    # geometric mean over prompts
    two = [_summary("off", 1.0, prompt="a"), _summary("off", 1.0, prompt="b"),
           _summary("γ=1", 2.0, prompt="a"), _summary("γ=1", 0.9, prompt="b"),
           _summary("γ=2", 1.3, prompt="a"), _summary("γ=2", 1.3, prompt="b")]
    assert sweep.recommend(two)[0] == "γ=1"


def test_committed_prompts():
    prompts = committed_prompts()
    assert set(prompts) == {"short", "long", "window", "quote"}
    assert len(prompts["short"]) < len(prompts["long"]) < len(prompts["window"])
    # Gemma averages ~1.3 tokens per English word: the window prompt is well past 512 tokens.
    assert len(prompts["window"].split()) > 600
    assert resolve_prompt("short")[0] == "short"
    assert resolve_prompt("some text") == ("custom", "some text", 0)


# -- the command -------------------------------------------------------------------------


def test_table_output(models):
    result = invoke(["bench", *models, *FAST, "--gamma", "1,2"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    out = result.stdout
    for needle in ("γ sweep", "off", "γ=1", "γ=2", "speedup", "Thm 3.8", "cost model", "α̂",
                   "by position", "md5", "✓", "every setting's tokens equal drafting off's", "recommendation:",
                   "cost curve"):
        assert needle in out, needle
    assert not has_ansi(out) and not has_ansi(result.stderr)
    assert "[1/6] bench custom off cold" in result.stderr  # plain progress lines when piped
    assert "±0%" not in out and "—" in out  # one warm run has no spread to show


def test_json_schema_and_identity(models):
    out = invoke_json(["bench", *models, *FAST, "--gamma", "1", "--gamma", "3", "--auto"])
    assert out["ok"] and out["identity_checked"] and out["mismatches"] == []
    assert out["drafter"] == "model" and out["warm_runs"] == 1 and out["max_tokens"] == 12
    assert out["models"]["target"].endswith("target")
    assert {"verify", "draft_step", "c", "context"} <= set(out["costs"])
    settings = [s["setting"] for s in out["settings"]]
    assert settings == ["off", "γ=1", "γ=3", "auto"]
    md5s = {s["md5"] for s in out["settings"]}
    assert len(md5s) == 1
    for s in out["settings"]:
        assert s["identical"] is True and s["runs"] == 1 and s["decode_tps"] > 0
        assert {"speedup", "predicted_speedup", "cost_model_speedup", "acceptance_rate",
                "acceptance_by_position", "mean_accepted_length", "prefill_time", "prefill_share",
                "cold_tps", "spread", "bandwidth"} <= set(s)
    base = out["settings"][0]
    assert base["speedup"] == 1.0 and base["acceptance_by_position"] == []
    g3 = out["settings"][2]
    assert len(g3["acceptance_by_position"]) == 3 and 0 < g3["acceptance_rate"] <= 1
    assert out["recommendation"]["setting"] in settings


def test_injected_mismatch_fails_loudly(models, monkeypatch):
    """A verifier that corrupts the target's token whenever something was drafted: every
    γ > 0 output diverges from the baseline and the command must say so and exit 1."""
    import mlx_spec.core.verify as engine  # the verify functions the engine calls

    real = engine.verify_greedy

    def corrupted(x, target_tokens):
        n, token = real(x, target_tokens)
        if x.shape[0]:
            token = (token + 1) % 200 + 6
        return engine.Verdict(n, token)

    monkeypatch.setattr(engine, "verify_greedy", corrupted)
    result = invoke(["bench", *models, *FAST, "--gamma", "2"])
    assert result.exit_code == 1
    assert "IDENTITY CHECK FAILED" in result.stderr
    first = re.search(r"setting γ=2, cold run, first differing token index (\d+); the target's top-2 "
                      r"logits there are \S+ apart, past the near-tie tolerance", result.stderr)
    assert first, result.stderr
    assert f"✗ differs at token {first.group(1)}" in result.stdout
    # The JSON says so too, and still exits non-zero.
    result = invoke(["bench", *models, *FAST, "--gamma", "2", "--json"])
    assert result.exit_code == 1
    out = json.loads(result.stdout)
    assert not out["ok"] and out["mismatches"][0]["setting"] == "γ=2"
    assert not out["mismatches"][0]["near_tie"] and out["mismatches"][0]["gap"] > out["mismatches"][0]["tolerance"]
    assert out["recommendation"]["setting"] == "off"


def test_temperature_rerun_reports_without_identity_check(models):
    result = invoke(["bench", *models, *FAST, "--gamma", "2", "--temp", "0.8"])
    assert result.exit_code == 0, result.stderr
    assert "no identity check" in result.stdout
    out = invoke_json(["bench", *models, *FAST, "--gamma", "2", "--temp", "0.8"])
    assert not out["identity_checked"] and out["sampling"]["temperature"] == 0.8
    assert all(s["identical"] is None for s in out["settings"])


def test_csv_and_plot(models, tmp_path):
    pytest.importorskip("matplotlib")
    csv_path, png = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    result = invoke(["bench", *models, *FAST, "--gamma", "1,2", "--auto", "--csv", csv_path, "--plot", png])
    assert result.exit_code == 0, result.stderr
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["setting"] for r in rows] == ["off", "γ=1", "γ=2", "auto"]
    assert float(rows[1]["decode_tps"]) > 0 and rows[2]["acceptance_by_position"].count(";") == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_csv_to_stdout_and_committed_prompts(models):
    result = invoke(["bench", *models, "--prompt", "short", "--prompt", "Hi", "--runs", "1", "-n", "6",
                     "--gamma", "1", "--csv", "-", "--json"])
    assert result.exit_code == 0, result.stderr
    first, _, rest = result.stdout.partition("\n")
    out = json.loads(first)
    assert out["prompts"]["short"] > out["prompts"]["custom"]
    rows = list(csv.DictReader(rest.splitlines()))
    assert [r["prompt"] for r in rows] == ["short", "short", "custom", "custom"]


def test_a_model_free_drafter_without_a_draft_model(tiny_dirs):
    """suffix by default (drafting without its memory of earlier runs: every run is the
    same prompt), ngram when asked."""
    target, _ = tiny_dirs
    out = invoke_json(["bench", "--model", target, *FAST, "--gamma", "2"])
    assert out["drafter"] == "suffix" and out["ok"] and out["costs"]["draft_step"] == 0.0
    out = invoke_json(["bench", "--model", target, *FAST, "--gamma", "2", "--drafter", "ngram"])
    assert out["drafter"] == "ngram" and out["ok"]


@pytest.mark.parametrize("extra, fragment", [
    (["--gamma", "0"], "--gamma"),
    (["--gamma", "x"], "x"),
    (["--drafter", "none"], "--drafter"),
    (["--prompt", "@/no/such/file.txt"], "/no/such/file.txt"),
    (["--plot", "out.jpg"], ".png"),
])
def test_bench_errors(models, extra, fragment):
    result = invoke(["bench", *models, "--runs", "1", *extra])
    if extra[1].startswith("@"):  # a file that is not there: exit 1
        assert_one_line_error(result, fragment)
    else:  # a value bench refuses: a usage error, exit 2
        assert_usage_error(result, fragment)


def test_plot_without_matplotlib(models, monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert_one_line_error(invoke(["bench", *models, *FAST, "--plot", tmp_path / "x.png"]), "matplotlib")


def test_recommendation_text_flags_gains_within_noise():
    from mlx_spec.core.cost_model import CostCurve
    from mlx_spec.core.sampling import SamplingParams

    def result(rows, best, speedup):
        return sweep.SweepResult(rows, [], [], best, speedup, CostCurve([1.0], 0.0, 256),
                                 SamplingParams(), {"p": 3}, "model", 8, 1)

    noisy = [_summary("off", 1.0), _summary("γ=2", 1.03)]
    noisy[0].spread = 0.10
    assert "within the run-to-run spread" in recommendation_text(result(noisy, "γ=2", 1.03))
    clear = [_summary("off", 1.0), _summary("γ=2", 1.5)]
    assert recommendation_text(result(clear, "γ=2", 1.5)) == "recommendation: --gamma 2 (1.50× vs drafting off)"
    assert "does not pay" in recommendation_text(result(clear, "off", 1.0))


def test_a_difference_at_a_near_tie_is_reported_apart_from_a_mismatch(tiny_dirs, tmp_path, monkeypatch):
    """On a GPU a multi-row verify and a one-row step run different kernels, so an argmax can
    flip where the target's top-2 logits tie to rounding. Here token B's embedding row is a
    copy of token A's, so their logits tie exactly at every position; a verifier that picks
    B over A whenever it drafted makes every drafted run differ there. That is reported as a
    numerical near-tie (gap 0) and the command succeeds; the gap-checked mismatch test above
    still fails loudly."""
    import mlx.core as mx
    from conftest import greedy_reference
    from mlx_lm import load

    import mlx_spec.core.verify as engine  # the verify functions the engine calls
    from mlx_spec.testing.tiny import save_tiny_model

    model, tokenizer = load(tiny_dirs[0])
    prompt = list(tokenizer.encode("Hello there"))
    plain = greedy_reference(model, prompt, 12)
    a, b = plain[3], model.model.embed_tokens.weight.shape[0] - 1
    assert a < b and b not in plain
    weight = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = mx.concatenate([weight[:b], weight[a : a + 1]])
    model.config = json.loads(open(f"{tiny_dirs[0]}/config.json").read())
    twin = str(save_tiny_model(tmp_path / "twin", model))

    real = engine.verify_greedy

    def prefer_the_twin(x, target_tokens):
        if x.shape[0]:
            target_tokens = mx.where(target_tokens == a, b, target_tokens)
        return real(x, target_tokens)

    monkeypatch.setattr(engine, "verify_greedy", prefer_the_twin)
    result = invoke(["bench", "-m", twin, "-d", twin, *FAST, "--gamma", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["ok"] and out["mismatches"]
    first = out["mismatches"][0]
    assert first["near_tie"] and first["gap"] == 0.0 and first["tolerance"] > 0
    assert first["index"] == plain.index(a)
    assert "numerical near-tie, not an exactness failure" in result.stderr
    assert "IDENTITY CHECK FAILED" not in result.stderr
    g2 = out["settings"][1]
    assert g2["identical"] is False and g2["near_tie"] is True
    # Drafting off chose A, tied with B, at each of these places, and nowhere else tied.
    (ties,) = out["baseline_near_ties"].values()
    assert ties == [i for i, t in enumerate(plain) if t == a]
    table = invoke(["bench", "-m", twin, "-d", twin, *FAST, "--gamma", "2"])
    count = len(ties)
    assert (f"Near-ties: at {count} token{'s' if count != 1 else ''} of drafting off's output the top two "
            "logits were within rounding" in " ".join(table.stdout.split()))  # Rich wraps long lines


def test_identity_note_names_near_ties_only_where_there_are_some():
    """Issue 45: the footnote read "...; drafting off chose 0 tokens at a numerical near-tie,
    where an exact setting may differ" on every clean run."""
    from types import SimpleNamespace

    from mlx_spec.cli.bench import identity_note

    clean = SimpleNamespace(ok=True, near_ties=[], baseline_near_ties={"quote": []})
    assert identity_note(clean) == "identity (md5 of token ids, T = 0): every setting's tokens equal drafting off's."
    tied = SimpleNamespace(ok=True, near_ties=["..."], baseline_near_ties={"quote": [3], "long": [7, 9]})
    note = identity_note(tied)
    assert "except at near-ties (stderr names them)." in note
    assert "Near-ties: at 3 tokens of drafting off's output the top two logits were within rounding" in note
    one = identity_note(SimpleNamespace(ok=True, near_ties=[], baseline_near_ties={"quote": [3]}))
    assert "at 1 token of" in one and "OUTPUT MISMATCH" in identity_note(SimpleNamespace(
        ok=False, near_ties=[], baseline_near_ties={}))


def test_theorem_3_8_takes_alpha_per_reached_position():
    """Every round accepts x_1 and rejects x_2 of γ = 4: α̂ (accepted / drafted) is 0.25,
    but each reached position is accepted half the time, and that is the theorem's α."""
    from mlx_spec.core.cost_model import CostCurve
    from mlx_spec.core.sampling import SamplingParams
    from mlx_spec.core.stats import Stats

    stats = Stats()
    for _ in range(10):
        stats.observe_round(4, 1, 2, 0.0, 0.01)
    runs = [sweep.Run("p", "γ=4", 4, rep, [], stats) for rep in (0, 1)]
    summary = sweep._summarize(runs, CostCurve([1.0] * 8, 0.0, 256), SamplingParams())
    assert summary.acceptance_rate == 0.25
    assert summary.predicted_speedup == pytest.approx(theorem_speedup(0.5, 4, 0.0))


# -- bench --clients ---------------------------------------------------------------------

CLIENTS = ["--prompt", "Hello there", "--prompt", "Once upon a time", "--runs", "1", "--max-tokens", "12"]


def _plain_md5s(target_dir, texts, max_tokens):
    """md5 of mlx-lm's greedy decoding of each text, cut after its first EOS id."""
    from conftest import greedy_reference
    from mlx_lm import load

    model, tokenizer = load(target_dir)
    eos = set(tokenizer.eos_token_ids)
    out = []
    for text in texts:
        tokens = greedy_reference(model, list(tokenizer.encode(text)), max_tokens)
        ends = [i for i, t in enumerate(tokens) if t in eos]
        out.append(sweep.token_md5(tokens[: ends[0] + 1] if ends else tokens))
    return out


def test_clients_runs_the_requests_together_and_each_answer_is_plain_decoding(models, tiny_dirs):
    out = invoke_json(["bench", *models, *CLIENTS, "--clients", "3", "--gamma", "2,auto"])
    assert out["clients"] == 3 and out["max_tokens"] == 12 and out["runs"] == 1
    assert [s["setting"] for s in out["settings"]] == ["off", "γ=2", "auto"]
    expected = _plain_md5s(tiny_dirs[0], ["Hello there", "Once upon a time", "Hello there"], 12)
    for s in out["settings"]:
        assert s["md5s"] == expected and s["identical"] is True
        assert s["aggregate_tps"] > 0 and s["per_request_tps"] > 0 and 0 < s["ttft"] <= s["max_ttft"]
        assert s["mean_batch"] > 1  # the three shared forwards
    assert out["settings"][0]["acceptance_rate"] is None and 0 < out["settings"][1]["acceptance_rate"] <= 1


def test_clients_table_and_a_corrupted_batch_fails_loudly(models, monkeypatch):
    result = invoke(["bench", *models, *CLIENTS, "--clients", "2", "--gamma", "2"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    for needle in ("2 clients at once", "aggregate tok/s", "per request tok/s", "TTFT s", "α̂", "✓"):
        assert needle in result.stdout, needle
    import mlx_spec.core.verify as engine  # the verify functions the engine calls

    real = engine.verify_greedy

    def corrupted(x, target_tokens):
        n, token = real(x, target_tokens)
        return engine.Verdict(n, (token + 1) % 200 + 6 if x.shape[0] else token)

    monkeypatch.setattr(engine, "verify_greedy", corrupted)
    result = invoke(["bench", *models, *CLIENTS, "--clients", "2", "--gamma", "2"])
    assert result.exit_code == 1 and "IDENTITY CHECK FAILED" in result.stderr
    assert_usage_error(invoke(["bench", *models, *CLIENTS, "--clients", "2", "--tree"]), "--clients")
