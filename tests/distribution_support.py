"""Shared by several test modules; moved from test_distribution.py."""

import math

import mlx.core as mx
import pytest

from mlx_spec.core.sampling import LogitProcessor, SamplingParams, draw
from mlx_spec.core.verify import Verdict, accepted_prefix, verify_sampled
from mlx_spec.testing.tiny import tiny_gemma3

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
