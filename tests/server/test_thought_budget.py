"""A thought budget (Anthropic's `budget_tokens`) ends the thought, not the answer's random
stream (issue 45 item 4): the answer's runs before and after the forced end marker draw from
one stream of keys (the second used to restart it from the seed and repeat the first's
draws), and where no thought is open at the budget nothing is split at all: the answer is
the one the same seed gives without a budget.

The worker runs the tiny Gemma 3 pair in-process; its jobs carry thought markers the random
model never writes, so a thought opened by the prompt stays open. Stop strings straddling
the budget: tests/server/test_server_thinking.py.
"""

import numpy as np
import pytest
from worker_support import make_worker, pair, run_jobs  # noqa: F401  (pair: a fixture)

import mlx_spec.core.engine as engine_module
from mlx_spec.apps.thinking import ThinkSyntax
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.server.worker import Done

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, private_cost_cache

SEEDED = SamplingParams(temperature=1.0, seed=7)
MARKERS = ThinkSyntax("<think>", "</think>")
BUDGET, MAX_TOKENS = 10, 40
PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(30)]


def job(**thought) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "params": SEEDED, "think": MARKERS, **thought}


@pytest.mark.parametrize("gamma", ["0", "2"])
def test_the_runs_around_a_forced_thought_end_draw_from_one_random_stream(pair, monkeypatch, gamma):  # noqa: F811
    keys, verify = [], engine_module.verify_block

    def recording(*args, key, **kwargs):
        keys.append(tuple(np.array(key).tolist()))
        return verify(*args, key=key, **kwargs)

    monkeypatch.setattr(engine_module, "verify_block", recording)
    tokens, done = run_jobs(make_worker(pair, parallel=1, gamma=gamma), [job(thinking=True, thought_budget=BUDGET)])[0]
    assert isinstance(done, Done) and done.finish_reason == "length"
    forced = len(pair[2].encode(MARKERS.end, add_special_tokens=False))
    assert done.completion_tokens == MAX_TOKENS == len(tokens) + forced  # the marker was forced in
    assert len(keys) > BUDGET // 3 and len(set(keys)) == len(keys)  # no round's key came round again


def test_a_budget_with_no_thought_open_splits_nothing(pair):  # noqa: F811
    """No thought open at the budget (none begun here; a thought the model closes early:
    tests/server/test_server_thinking.py): the seed's answer without a budget."""
    with_budget = run_jobs(make_worker(pair, parallel=1, gamma="0"), [job(thought_budget=BUDGET)])[0]
    without = run_jobs(make_worker(pair, parallel=1, gamma="0"), [job()])[0]
    assert with_budget[0] == without[0] and with_budget[1].completion_tokens == MAX_TOKENS
