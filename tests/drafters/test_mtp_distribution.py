"""Temperature > 0 with the MTP drafter: output is distributed exactly as the target's.

The assistant drafts its argmax, so q is one-hot (Draft.q = None) and a draft token x is
accepted with probability p(x), else the recovered token comes from norm(max(0, p − 1_x)).
On a tiny Gemma 4 target with an 8-token vocabulary the exact joint distribution of the first
two tokens is computed from the target's logits (top-k, top-p and repetition penalty on);
sampled speculative runs must fit it (chi-square, as tests/core/test_distribution.py.py). The first
round of a request is plain (no hidden state yet), so the second token is the one that went
through drafting and verification. The same check rejects a rule that draws the recovered
token from p instead of the residual (measured: 154 at 500 draws against a critical value
of 75; the exact rule scored 30), which shows it has the power to.
"""

import mlx.core as mx
import pytest
from batch_support import exact_joints, sampled_joints
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, sampled_joint

import mlx_spec.core.verify as verify_module
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams, draw
from mlx_spec.core.stats import Stats
from mlx_spec.core.verify import Verdict, accepted_prefix
from mlx_spec.drafters.mtp import MtpDrafter
from mlx_spec.models import gemma4_assistant
from mlx_spec.testing.tiny_gemma4 import tiny_assistant_config, tiny_assistant_weights, tiny_gemma4

DRAWS = 1000
BROKEN_DRAWS = 500
GAMMA = 2  # runs of γ + 1 = 3 tokens: round 1 plain, round 2 drafts one (the room left)


@pytest.fixture(scope="module")
def models():
    # A flat target and an assistant whose drafts the target finds likely (p(x) near 1/2 in
    # places): a one-hot draft then changes the joint distribution most when mishandled.
    target = tiny_gemma4(seed=1, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, logit_scale=0.5)
    config = tiny_assistant_config(target.config, centroids=False)
    assistant = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_dict(config))
    assistant.load_weights([(k, mx.array(v)) for k, v in tiny_assistant_weights(config, 3).items()])
    return target, assistant


def test_mtp_sampling_matches_target_distribution(models):
    target, assistant = models
    params = SamplingParams(**PARAMS)
    engine = Engine(target, MtpDrafter(assistant, target))
    stats = Stats()
    list(engine.rounds([2, 5, 3, 5, 1], SamplingParams(**PARAMS), gamma=3, max_tokens=4, stats=stats))
    assert stats.drafted > 0  # round 1 is plain (no hidden state yet), then it drafts
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, DRAWS), exact_joint(target, params))
    assert stat < critical


BATCH_DRAWS = 300
BATCH_GAMMAS = [2] * 4  # round 1 drafts (from the prefill's hidden state), as GAMMA above


def test_each_mtp_row_of_a_batch_of_four_samples_the_target_distribution(models):
    """Four MTP requests whose assistant steps share calls (`mlx_spec.core.batch`), each with
    its own seed and prompt: every row's first two tokens fit the target's exact joint."""
    target, assistant = models
    params = SamplingParams(**PARAMS)
    engines = [Engine(target, MtpDrafter(assistant, target)) for _ in BATCH_GAMMAS]
    for counts, joint in zip(sampled_joints(engines, BATCH_GAMMAS, params, BATCH_DRAWS),
                             exact_joints(target, params)):
        stat, critical = chi_square(counts, joint)
        assert stat < critical


def recovered_from_p_one_hot(x, q, p, key):
    """Broken: with one-hot q, accept x with probability p(x) but on rejection draw the
    recovered token from p instead of norm(max(0, p − 1_x))."""
    key_accept, key_token = mx.random.split(key)
    gamma = x.shape[0]
    p_x = mx.take_along_axis(p[:gamma], x[:, None], axis=-1)[:, 0]
    n = accepted_prefix(mx.random.uniform(shape=(gamma,), key=key_accept) < p_x)
    return Verdict(n, draw(mx.take(p, n, axis=0), key_token))


def test_the_check_catches_a_broken_recovery(models, monkeypatch):
    target, assistant = models
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", recovered_from_p_one_hot)
    engine = Engine(target, MtpDrafter(assistant, target))
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, BROKEN_DRAWS), exact_joint(target, params))
    assert stat > critical


@pytest.mark.slow  # the batched check's power, shown once
def test_the_batched_mtp_check_catches_a_broken_recovery(models, monkeypatch):
    target, assistant = models
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", recovered_from_p_one_hot)
    engines = [Engine(target, MtpDrafter(assistant, target)) for _ in BATCH_GAMMAS]
    stats = [chi_square(counts, joint) for counts, joint in
             zip(sampled_joints(engines, BATCH_GAMMAS, params, BATCH_DRAWS), exact_joints(target, params))]
    assert any(stat > critical for stat, critical in stats)
