"""`generate`, `chat` and `bench` across 2 ring ranks on localhost, as users run them:
under `mlx.launch` (or ranks started with MLX_RANK / MLX_HOSTFILE where one rank needs
different arguments or stdin). The reference is the same command in one process, which
tests/apps/test_distributed.py.py ties to mlx-lm's own greedy decoding.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from cli_support import assert_usage_error, invoke, invoke_json
from dist_support import spawn_ranks

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

CLI = [sys.executable, "-m", "mlx_spec.cli"]
# mlx.launch's console script, run by this interpreter (the one with mlx installed).
LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()",
          "--backend", "ring", "-n", "2", "--"]
PROMPT = "abcabcabcabc hello hello"


def launch(args, timeout=150) -> subprocess.CompletedProcess:
    """`mlx.launch --backend ring -n 2 -- python -m mlx_spec.cli ARGS`."""
    return subprocess.run(LAUNCH + CLI + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def test_generate_across_two_ranks_matches_one_process_and_prints_once(models):
    args = ["generate", *models, "--gamma", "auto", "--max-tokens", 24, "--raw", PROMPT, "--json"]
    single = invoke_json(args)
    result = launch(args)
    assert result.returncode == 0 and "error" not in result.stderr, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout  # rank 0 alone prints
    out = json.loads(lines[0])
    assert out["text"] == single["text"] and out["finish_reason"] == single["finish_reason"]
    assert out["stats"]["generated"] == 24 and out["stats"]["drafted"] > 0


def test_chat_input_reaches_every_rank(models, tmp_path):
    """stdin goes to rank 0 only (no launcher forwarding it): rank 1 follows the
    conversation, slash commands included, through the broadcast."""
    lines = "hello there\n/gamma 1\nand again\n/quit\n"
    argv = CLI + ["chat", *models, "--gamma", "3", "--max-tokens", "12"]
    ranks = spawn_ranks([argv, argv], tmp_path, stdin=lines, timeout=150)
    assert [r.returncode for r in ranks] == [0, 0], ranks[1].stderr + ranks[0].stderr
    assert ranks[1].stdout == "" and ranks[1].stderr == ""
    single = invoke(["chat", *models, "--gamma", "3", "--max-tokens", "12"], input=lines)

    def transcript(text):  # footers ("[... tok/s ...]", wrapped) carry timings
        return re.sub(r"\[[^\]]*tok/s[^\]]*\]", "[footer]", text)

    assert transcript(ranks[0].stdout) == transcript(single.stdout)
    assert ranks[0].stdout.count("tok/s") == 2


@pytest.mark.parametrize("bad", ["missing", "empty"])
def test_a_rank_that_cannot_load_ends_every_rank_with_one_line(tiny_dirs, tmp_path, bad):
    """A path that does not exist fails the checks before loading; an empty folder fails
    while loading. Either way only the rank that failed speaks."""
    target, _ = tiny_dirs
    path = tmp_path / bad
    if bad == "empty":
        path.mkdir()
    start = time.monotonic()
    ranks = spawn_ranks([CLI + ["generate", "-m", target, "--raw", "hi"],
                         CLI + ["generate", "-m", str(path), "--raw", "hi"]],
                        tmp_path, timeout=90)
    assert time.monotonic() - start < 90
    assert [r.returncode for r in ranks] == [1, 1]
    assert ranks[0].stdout == ranks[0].stderr == "" and ranks[1].stdout == ""
    error = ranks[1].stderr.strip().splitlines()
    expected = ("no such file or folder" if bad == "missing" else "has no config.json")
    assert error[0].startswith("error: rank 1: target model: ") and expected in error[0], error
    assert len(error) == 1 and "Traceback" not in ranks[1].stderr  # the debug hint is on that line


def test_an_error_every_rank_hits_is_said_once(models):
    result = launch(["generate", *models, "--gamma", "99", "--raw", "hi"], timeout=90)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --gamma must be between 0 and 16, or 'auto' (got 99) "
                      "(see 'python -m mlx_spec.cli generate --help')"], \
        result.stderr


def test_bench_reports_all_reduces_and_single_machine_speedup(models, tmp_path):
    args = ["bench", *models, "--gamma", "1,3", "--runs", 1, "--max-tokens", 12, "--prompt", PROMPT]
    single = invoke_json(args)
    (tmp_path / "one.json").write_text(json.dumps(single))
    result = launch(args + ["--json", "--compare", tmp_path / "one.json"])
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    tp = out["tensor_parallel"]
    assert tp["ranks"] == 2 and tp["per_forward"] == 8  # 4 layers × (o_proj, down_proj)
    assert out["ok"] and {s["md5"] for s in out["settings"]} == {single["settings"][0]["md5"]}
    by_setting = {s["setting"]: s for s in out["settings"]}
    assert by_setting["off"]["all_reduces_per_round"] == 9  # + rank 0's verdict
    assert 9 < by_setting["γ=3"]["all_reduces_per_round"] <= 10  # + the draft in drafted rounds
    singles = {s["setting"]: s["speedup"] for s in single["settings"]}
    assert all(s["single_speedup"] == singles[s["setting"]] for s in out["settings"])
    assert all(s["comm_time_per_round"] > 0 for s in out["settings"])


def test_draft_on_must_be_root_or_all(models):
    assert_usage_error(invoke(["generate", *models, "--draft-on", "rank1", "--raw", "hi"]),
                          "--draft-on must be root or all")


def test_serve_refuses_to_run_across_ranks(models):
    result = launch(["serve", *models, "--port", 0], timeout=90)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: serve does not run across ranks (mlx.launch); generate, chat and bench do "
                      "(--debug for the traceback)"], result.stderr
