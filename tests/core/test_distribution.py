"""Temperature > 0: speculative sampling draws from exactly the target's distribution.

On an 8-token vocabulary the exact joint distribution of the first two generated tokens
under target-only sampling (top-k, top-p and repetition penalty active) is computed from
the target's logits; thousands of speculative draws must fit it (chi-square test). The same
test must reject deliberately broken acceptance rules, which shows it has the power to.
"""


import mlx.core as mx
import pytest
from distribution_support import (  # noqa: F401
    BROKEN_DRAWS,
    DRAWS,
    PARAMS,
    PROMPT,
    VOCAB,
    chi_square,
    exact_joint,
    models,
    recovered_from_p,
    sampled_joint,
)

import mlx_spec.core.verify as verify_module
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams, draw
from mlx_spec.core.verify import Verdict, accepted_prefix, verify_sampled
from mlx_spec.drafters import ModelDrafter, NgramDrafter


@pytest.mark.parametrize(
    "drafter_kind,gamma",
    [
        ("model", 3),
        ("none", 0),  # plain rounds, the second queued while the first is computed
        pytest.param("model", 1, marks=pytest.mark.slow),
        pytest.param("ngram", 3, marks=pytest.mark.slow),
    ],
)
def test_speculative_sampling_matches_target_distribution(models, drafter_kind, gamma):
    target, draft = models
    params = SamplingParams(**PARAMS)
    drafters = {"model": lambda: ModelDrafter(draft, VOCAB), "ngram": lambda: NgramDrafter(min_ngram=1), "none": lambda: None}
    engine = Engine(target, drafters[drafter_kind]())
    draws = DRAWS if gamma else DRAWS // 2  # plain rounds are cheaper to check
    stat, critical = chi_square(sampled_joint(engine, params, gamma, draws), exact_joint(target, params))
    assert stat < critical



def p_rows_off_by_one(x, q, p, key):
    """Broken: scores draft token i with the distribution meant for token i+1."""
    return verify_sampled(x, q, mx.concatenate([p[1:], p[-1:]]), key)


def deterministic_acceptance(x, q, p, key):
    """Broken: accepts x_i exactly when q(x_i) <= p(x_i), never by chance otherwise."""
    if q is None:
        return verify_sampled(x, q, p, key)
    gamma = x.shape[0]
    p_x = mx.take_along_axis(p[:gamma], x[:, None], axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    n = accepted_prefix(q_x <= p_x)
    q_n = mx.take(mx.concatenate([q, mx.zeros((1, p.shape[-1]))]), n, axis=0)
    residual = mx.maximum(mx.take(p, n, axis=0) - q_n, 0)
    return Verdict(n, draw(residual / residual.sum(), key))


@pytest.mark.parametrize(
    "broken",
    [
        recovered_from_p,
        pytest.param(p_rows_off_by_one, marks=pytest.mark.slow),
        pytest.param(deterministic_acceptance, marks=pytest.mark.slow),
    ],
)
def test_the_check_catches_broken_rules(models, monkeypatch, broken):
    target, draft = models
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", broken)
    engine = Engine(target, ModelDrafter(draft, VOCAB))
    stat, critical = chi_square(sampled_joint(engine, params, 3, BROKEN_DRAWS), exact_joint(target, params))
    assert stat > critical
