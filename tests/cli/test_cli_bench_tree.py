"""`mlx-spec bench --tree`: draft trees beside the γ sweep, md5-checked against drafting off,
with acceptance by sibling rank and the cost model's forecast."""

import json

import pytest
from cli_support import invoke, invoke_json

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

# " the" is followed by three different words: the default (suffix) drafter branches at the
# end, as n-gram does
BRANCHING = ["--prompt", "the cat sat. the dog ran. the cow ate. the", "--runs", "1", "--max-tokens", "16"]


def test_tree_beside_the_sweep(tiny_dirs):
    target, _ = tiny_dirs
    out = invoke_json(["bench", "--model", target, *BRANCHING, "--gamma", "2", "--tree"])
    assert out["ok"] and out["drafter"] == "suffix"
    tree = next(s for s in out["settings"] if s["setting"] == "tree")
    assert [s["setting"] for s in out["settings"]] == ["off", "γ=2", "tree"]
    assert tree["identical"] is True and tree["md5"] == out["settings"][0]["md5"]
    assert tree["acceptance_by_rank"] and tree["predicted_speedup"] is None and tree["cost_model_speedup"] > 0
    assert len(out["costs"]["verify"]) >= 2
    table = invoke(["bench", "--model", target, *BRANCHING, "--gamma", "2", "--tree"])
    assert table.exit_code == 0 and "by rank" in table.stdout and "tree" in table.stdout


def test_a_corrupted_tree_verdict_fails_the_identity_check(tiny_dirs, monkeypatch):
    import mlx_spec.core.verify as engine  # the verify functions the engine calls

    real = engine.verify_tree_greedy

    def corrupted(x, shape, target_tokens):
        verdict = real(x, shape, target_tokens)
        return verdict._replace(token=(verdict.token + 1) % 200 + 6)

    monkeypatch.setattr(engine, "verify_tree_greedy", corrupted)
    target, _ = tiny_dirs
    result = invoke(["bench", "--model", target, *BRANCHING, "--gamma", "2", "--tree", "--json"])
    assert result.exit_code == 1
    out = json.loads(result.stdout)
    assert [m["setting"] for m in out["mismatches"]] == ["tree", "tree"]  # cold and warm run


def test_generate_with_trees_reports_acceptance_by_rank(tiny_dirs):
    """`--gamma tree` with the default (suffix) drafter: the same tokens as plain decoding, and the
    stats in --json, the panel and the summary line say how each sibling rank fared."""
    target, _ = tiny_dirs
    text = "the cat sat. the dog ran. the cow ate. the"
    plain = invoke_json(["generate", text, "--model", target, "-n", "24", "--raw", "--gamma", "0"])
    tree = invoke_json(["generate", text, "--model", target, "-n", "24", "--raw", "--gamma", "tree"])
    assert tree["text"] == plain["text"] and tree["gamma"] == "tree" and tree["drafter"] == "suffix"
    stats = tree["stats"]
    # (siblings below the root are tried only where their parent is accepted: test_trees.py)
    assert stats["tree_rounds"] > 0 and stats["acceptance_by_rank"] and stats["tried_at_rank"][0] > 0
    piped = invoke(["generate", text, "--model", target, "-n", "24", "--raw", "--gamma", "tree"])
    assert piped.exit_code == 0 and "γ tree (now" in piped.stderr and "by sibling rank" in piped.stderr
    from rich.console import Console

    from mlx_spec.apps.runner import Gamma
    from mlx_spec.cli.render import View, render_stats
    from mlx_spec.core.stats import Stats

    view = View(Stats(**{k: v for k, v in stats.items() if k in Stats.__dataclass_fields__}), "ngram", Gamma("tree"), 3, 0.0)
    console = Console(width=100, record=True)
    console.print(render_stats(view))
    panel = console.export_text()
    assert "depth 1" in panel and "sibling rank 0" in panel


def test_a_bad_gamma_names_the_choices(tiny_dirs):
    target, _ = tiny_dirs
    result = invoke(["generate", "hi", "--model", target, "--gamma", "bush"])
    assert result.exit_code != 0 and "'auto' (or 'tree')" in result.stderr
