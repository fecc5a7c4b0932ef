"""lm-eval's `local-completions` against `serve` (issue 42, item 6): a multiple-choice task and
a generate_until task, both committed (tests/data/lm_eval/), no hub access, lm-eval's remote
tokenizer (`/tokenizer_info`, `/tokenize`, `/detokenize`) and token-id prompts. Each
choice's log-likelihood lm-eval reports equals the sum mlx-lm's own forward of the same ids
gives.

Skipped where lm-eval cannot be run: `pip install "lm-eval[api]"` (it needs no torch), or
point MLX_SPEC_LM_EVAL_PATH at a folder it was installed into (`pip install --target`),
which is put on the harness's PYTHONPATH only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from server_support import server_env, serving

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = [pytest.mark.usefixtures("private_cost_cache"), pytest.mark.agents]

TASKS = Path(__file__).parents[1] / "data" / "lm_eval"
EXTRA_PATH = os.environ.get("MLX_SPEC_LM_EVAL_PATH", "")
HARNESS_ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (EXTRA_PATH, os.environ.get("PYTHONPATH", "")) if p)}


def lm_eval_runs() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import lm_eval.models.openai_completions"],
                           env=HARNESS_ENV, capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def spec_server(tiny_dirs, cost_cache):
    target, draft = tiny_dirs
    yield from serving(["--model", target, "--draft-model", draft, "--gamma", "2"], server_env(cost_cache))


@pytest.mark.skipif(not lm_eval_runs(), reason="lm-eval is not installed (pip install 'lm-eval[api]')")
def test_lm_eval_local_completions_loglikelihoods_are_the_targets(spec_server, tiny_dirs, tmp_path):
    args = ",".join([f"base_url={spec_server.base}/completions", "model=tiny", "tokenizer_backend=remote",
                     "tokenized_requests=True", "num_concurrent=1", "max_retries=1"])
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                          "--tasks", "tiny_choice,tiny_until", "--include_path", str(TASKS),
                          "--output_path", str(tmp_path / "out"), "--log_samples"],
                         cwd=TASKS, env={**HARNESS_ENV, "HF_HOME": str(tmp_path / "hf")},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    model, tokenizer = load(tiny_dirs[0])
    [samples] = (tmp_path / "out").rglob("samples_tiny_choice_*.jsonl")
    checked = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for arguments, [[loglikelihood, _]] in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            # lm-eval's own pairing: ids of the whole, the context's ids first (no BOS added)
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            start = len(tokenizer.encode(context, add_special_tokens=False))
            logits = model(mx.array(whole)[None])[0].astype(mx.float32)
            scores = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            expected = sum(scores[i - 1, whole[i]].item() for i in range(start, len(whole)))
            assert abs(float(loglikelihood) - expected) < 1e-3, (context, continuation)
            checked += 1
    assert checked == 5
    [results] = (tmp_path / "out").rglob("results_*.json")
    assert "exact_match,none" in json.loads(results.read_text())["results"]["tiny_until"]
