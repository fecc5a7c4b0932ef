"""One key schedule for a seeded sample, whatever runs its rounds (issue 45 item 3).

Every round splits the request's key the same way (draft, verify), whether it runs alone,
in a batch, or queued as a pipelined plain round. So a seeded sample draws the same tokens
from `Engine.rounds` alone (what `mlx-spec generate --seed` runs) as in a batch (what every
request on `serve --parallel 2` runs), and from `--parallel 2` as from `--parallel 1`: at
γ 0 (every round plain, pipelined alone) and under auto γ while it parks (plain rounds and
probes). References: the same request on the other path.
"""

import pytest
from batch_support import batched
from worker_support import make_worker, pair, run_jobs  # noqa: F401  (pair: a fixture)

from mlx_spec.core.cost_model import CostCurve
from mlx_spec.core.engine import Engine
from mlx_spec.core.policy import AutoGamma
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import ModelDrafter
from mlx_spec.server.worker import Done
from mlx_spec.testing.tiny import TINY_VOCAB

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, private_cost_cache

SEEDED = SamplingParams(temperature=1.0, seed=7)
MAX_TOKENS = 40
PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(44)]  # longer than the window
OTHER = [2, 40, 41, 42, 43, 44, 45, 40, 41]


def parking_policy() -> AutoGamma:
    """Auto γ on a curve where a draft step costs as much as a verify: it parks at γ 0 and
    probes now and then (a fixed curve: nothing learnt from the clock, as for a seeded request)."""
    return AutoGamma(CostCurve(verify=[0.1] * 8, draft_step=0.1, context=64), max_gamma=4, learn_costs=False,
                     probe_every=4, max_probe_every=4)


def setups(tiny_target, tiny_draft):
    return {"no drafter": lambda: (Engine(tiny_target), 0),
            "gamma 0": lambda: (Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)), 0),
            "auto, parked": lambda: (Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)), parking_policy())}


@pytest.mark.parametrize("setup", ["no drafter", "gamma 0", "auto, parked"])
def test_a_seeded_sample_draws_the_same_alone_and_in_a_batch(tiny_target, tiny_draft, setup):
    make = setups(tiny_target, tiny_draft)[setup]
    engine, gamma = make()
    stats = Stats()
    alone = [t for r in engine.rounds(PROMPT, SEEDED, gamma=gamma, max_tokens=MAX_TOKENS, stats=stats)
             for t in r.tokens]
    if setup == "auto, parked":
        assert 0 < stats.drafted and stats.rounds > 2 * stats.drafted  # plain rounds and probes
    engine, gamma = make()
    together = engine.rounds(PROMPT, SEEDED, gamma=gamma, max_tokens=MAX_TOKENS, batched=True)
    out = {together: []}
    batched([together], [0], out)
    assert out[together] == alone


@pytest.mark.parametrize("gamma", ["0", "auto"])
def test_a_seeded_job_draws_the_same_on_parallel_2_and_parallel_1(pair, private_cost_cache, gamma):  # noqa: F811
    """Beside another job on `--parallel 2`, and alone on `--parallel 1`."""
    seeded = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "params": SEEDED}
    other = {"prompt": OTHER, "max_tokens": MAX_TOKENS}
    together = run_jobs(make_worker(pair, parallel=2, gamma=gamma), [seeded, other])[0]
    alone = run_jobs(make_worker(pair, parallel=1, gamma=gamma), [seeded])[0]
    assert isinstance(together[1], Done) and together[1].batch_size == 2
    assert together[0] == alone[0]
