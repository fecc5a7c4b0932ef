"""Temperature > 0: speculative sampling draws from exactly the target's distribution.

On an 8-token vocabulary the exact joint distribution of the first two generated tokens
under target-only sampling (top-k, top-p and repetition penalty active) is computed from
the target's logits; thousands of speculative draws must fit it (chi-square test). The same
test must reject deliberately broken acceptance rules, which shows it has the power to.
"""

import math

import mlx.core as mx
import pytest

import mlx_spec.verify as verify_module
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.engine import Engine
from mlx_spec.testing.tiny import tiny_gemma3
from mlx_spec.sampling import LogitProcessor, SamplingParams, draw
from mlx_spec.verify import Verdict, accepted_prefix, verify_sampled

VOCAB = 8
PROMPT = [2, 5, 3, 5, 1]
DRAWS = 1500
BROKEN_DRAWS = 600  # broken rules score 4x+ the critical value already at 600 draws
PARAMS = dict(temperature=1.0, top_k=6, top_p=0.95, repetition_penalty=1.3, repetition_context=4)


@pytest.fixture(scope="module")
def models():
    target = tiny_gemma3(seed=0, vocab_size=VOCAB, logit_scale=2.0)
    draft = tiny_gemma3(seed=9, vocab_size=VOCAB, logit_scale=2.0)  # unrelated: many rejections
    return target, draft


def exact_joint(target, params, prompt=PROMPT):
    """P(t1, t2) after `prompt` under plain sampling from the target, computed, not sampled."""
    processor = LogitProcessor(params)

    def p_next(ids):
        logits = target(mx.array(ids)[None])[0, -1:]
        return processor.distribution(logits, processor.windows(ids, None, 1))[0]

    p1 = p_next(prompt)
    return {
        (a, b): p1[a].item() * p2b
        for a in range(VOCAB)
        if p1[a].item() > 0
        for b, p2b in enumerate(p_next(prompt + [a]).tolist())
        if p2b > 0
    }


def sampled_joint(engine, params, gamma, draws=DRAWS):
    counts = {}
    cache = engine.make_prompt_cache()  # reused: each draw rolls the last one's tokens back
    for seed in range(draws):
        run = SamplingParams(**{**params.__dict__, "seed": seed})
        rounds = engine.rounds(PROMPT, run, gamma=gamma, max_tokens=max(gamma + 1, 2), prompt_cache=cache)
        tokens = [t for r in rounds for t in r.tokens]
        key = (tokens[0], tokens[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square(counts, expected_probs):
    """Pearson's statistic and its 1e-4 critical value; cells expecting < 5 are pooled."""
    n = sum(counts.values())
    if any(cell not in expected_probs for cell in counts):
        return math.inf, 0.0  # a draw the target can never produce
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, prob in expected_probs.items():
        e, o = n * prob, counts.get(cell, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    k = cells - 1  # degrees of freedom; Wilson-Hilferty approximation, z = 3.719 (p = 1e-4)
    critical = k * (1 - 2 / (9 * k) + 3.719 * math.sqrt(2 / (9 * k))) ** 3
    return stat, critical


@pytest.mark.parametrize(
    "drafter_kind,gamma",
    [
        ("model", 1),  # t2 is the bonus token whenever x1 is accepted
        ("none", 0),  # plain rounds, the second queued while the first is computed
        pytest.param("model", 3, marks=pytest.mark.slow),  # t1, t2: accepted or recovered, never a bonus
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


def recovered_from_p(x, q, p, key):
    """Broken: on rejection, draw from p instead of norm(max(0, p - q))."""
    if q is None:
        return verify_sampled(x, q, p, key)
    key_accept, key_token = mx.random.split(key)
    gamma = x.shape[0]
    p_x = mx.take_along_axis(p[:gamma], x[:, None], axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    n = accepted_prefix(mx.random.uniform(shape=(gamma,), key=key_accept) * q_x < p_x)
    return Verdict(n, draw(mx.take(p, n, axis=0), key_token))


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


def bonus_from_the_last_draft_row(x, q, p, key):
    """Broken: when every draft token is accepted, draws the bonus token from p_γ (the last
    draft token's row) instead of p_γ+1."""
    return verify_sampled(x, q, mx.concatenate([p[:-1], p[-2:-1]]) if x.shape[0] else p, key)


@pytest.mark.parametrize(
    "broken,gamma",
    [
        (recovered_from_p, 3),
        pytest.param(p_rows_off_by_one, 3, marks=pytest.mark.slow),
        pytest.param(deterministic_acceptance, 3, marks=pytest.mark.slow),
        pytest.param(bonus_from_the_last_draft_row, 1, marks=pytest.mark.slow),  # the fast γ 1 check's bonus
    ],
)
def test_the_check_catches_broken_rules(models, monkeypatch, broken, gamma):
    target, draft = models
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", broken)
    engine = Engine(target, ModelDrafter(draft, VOCAB))
    stat, critical = chi_square(sampled_joint(engine, params, gamma, BROKEN_DRAWS), exact_joint(target, params))
    assert stat > critical
