"""The γ chooser on synthetic cost curves and acceptance profiles."""

import random

import pytest

from conftest import greedy_reference
import mlx.core as mx

from mlx_spec.cache import SequenceCache
from mlx_spec.costs import CostCurve, _fill_context, measure_costs
from mlx_spec.drafters import ModelDrafter
from mlx_spec.engine import Engine
from mlx_spec.models.tiny import TINY_VOCAB
from mlx_spec.policy import AutoGamma, expected_tokens
from mlx_spec.stats import Stats

# memory-bound (an Apple GPU at bf16): verifying more rows costs a little more
FLAT = CostCurve(verify=[1.0 + 0.02 * w for w in range(7)], draft_step=0.05, context=256)
# compute-bound (fp32 matmul on this CPU): cost grows with every row
LINEAR = CostCurve(verify=[1.0 * (w + 1) for w in range(7)], draft_step=0.05, context=256)
# in between: pays only when acceptance is high
STEEP = CostCurve(verify=[1.0 + 0.3 * w for w in range(7)], draft_step=0.05, context=256)


def trained(costs, acceptance, rounds=600, **kwargs):
    """A policy that has seen `rounds` rounds drafting len(acceptance) tokens, position i
    accepted with conditional probability acceptance[i] (seeded, so deterministic)."""
    rng = random.Random(0)
    policy = AutoGamma(costs, prior_weight=0.01, decay=1.0, **kwargs)
    for _ in range(rounds):
        accepted = 0
        while accepted < len(acceptance) and rng.random() < acceptance[accepted]:
            accepted += 1
        policy.observe(len(acceptance), accepted)
    return policy


def test_expected_tokens_formula():
    assert expected_tokens([0.8] * 5, 5) == pytest.approx((1 - 0.8**6) / (1 - 0.8))  # Theorem 3.8
    assert expected_tokens([0.9, 0.5], 2) == pytest.approx(1 + 0.9 + 0.45)
    assert expected_tokens([0.9, 0.5], 0) == 1.0


def test_high_acceptance_and_flat_costs_draft_long():
    assert trained(FLAT, [0.9] * 6).best() == 6


def test_moderate_acceptance_picks_the_hand_computed_optimum():
    # a = 0.6 on FLAT: E/T = 1.0, 1.50, 1.72, 1.80, 1.80(γ=4: 2.306/1.28), 1.77, 1.71
    policy = trained(FLAT, [0.6] * 6)
    rates = [policy.rate(g) for g in range(7)]
    assert max(range(7), key=rates.__getitem__) == policy.best()
    assert policy.best() in (3, 4)
    assert all(abs(a - 0.6) < 0.1 for a in policy.acceptance())


def test_falling_acceptance_stops_early():
    # position 3 almost never accepted: drafting it only costs
    policy = trained(FLAT, [0.95, 0.9, 0.05, 0.05, 0.05, 0.05])
    assert policy.best() == 2


def test_compute_bound_costs_never_draft_nor_probe():
    policy = trained(LINEAR, [0.95] * 6)
    assert policy.best() == 0
    assert policy.predicted_speedup(3) < 1.0
    assert not policy.can_pay  # not even a draft that is always right would pay
    assert [policy.choose(Stats()) for _ in range(300)] == [0] * 300


def test_two_token_draft_steps_after_full_acceptance_are_priced():
    cheap_catch_up = CostCurve(verify=[1.0 + 0.1 * w for w in range(7)], draft_step=0.2, context=256, draft_step2=0.2)
    dear_catch_up = CostCurve(verify=[1.0 + 0.1 * w for w in range(7)], draft_step=0.2, context=256, draft_step2=0.6)
    assert dear_catch_up.round_time(2, full_acceptance=1.0) == pytest.approx(0.4 + 0.4 + 1.2)
    assert dear_catch_up.round_time(0) == cheap_catch_up.round_time(0) == 1.0
    fast = trained(cheap_catch_up, [0.97] * 6)
    slow = trained(dear_catch_up, [0.97] * 6)
    assert slow.rate(3) < fast.rate(3)


def test_parks_probes_with_backoff_and_resumes():
    policy = AutoGamma(STEEP, prior=0.6, prior_weight=2.0, probe_every=4, max_probe_every=16)
    chosen = []
    for r in range(120):
        gamma = policy.choose(Stats())
        chosen.append(gamma)
        # the text is unpredictable for 60 rounds, then a quoted passage: all accepted
        accepted = 0 if r < 60 else gamma
        policy.observe(gamma, accepted)
    early = chosen[5:60]
    assert early.count(0) > 0.8 * len(early)  # parked
    probes = [i for i, g in enumerate(chosen[:60]) if g > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and gaps[-1] > gaps[0]  # probes back off while they keep losing
    assert all(g >= 1 for g in chosen[-20:])  # resumed once drafting paid again
    assert max(chosen[-20:]) >= 3


def test_cost_curve_noise_is_smoothed_to_non_decreasing():
    from mlx_spec.costs import non_decreasing

    assert non_decreasing([1.0, 2.0, 1.6, 1.8, 3.0]) == pytest.approx([1.0, 1.8, 1.8, 1.8, 3.0])
    assert non_decreasing([1.0, 1.1, 1.2]) == [1.0, 1.1, 1.2]


def test_measured_curve_has_one_entry_per_width(tiny_target, tiny_draft):
    # early_stop off: under CPU load a noisy first look can make widening look hopeless
    curve = measure_costs(tiny_target, tiny_draft, max_width=4, context=32, repeats=1, early_stop=False)
    assert len(curve.verify) == 4 and all(t > 0 for t in curve.verify)
    assert curve.draft_step > 0 and curve.draft_step2 > 0
    assert curve.verify_time(6) >= curve.verify_time(4)  # extrapolated, never shrinking


def test_timing_context_matches_a_real_prefill_in_shape(tiny_target):
    """Calibration pads the caches with zeros instead of prefilling: every layer must then
    hold what a real prefill leaves (offsets, attended keys), past the sliding window too."""
    context = 40  # the tiny model's window is 16
    real = SequenceCache(tiny_target, slack=8)
    real.prefill([(31 * i) % 100 + 10 for i in range(context)])
    filled = SequenceCache(tiny_target, slack=8)
    _fill_context(filled, context)
    assert [layer.offset for layer in filled.cache] == [layer.offset for layer in real.cache] == [context] * len(real.cache)

    def attended_keys(layer, n=3):  # what the next n queries attend to, then undone
        heads, k_dim, v_dim = layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3]
        keys, _ = layer.update_and_fetch(mx.zeros((1, heads, n, k_dim)), mx.zeros((1, heads, n, v_dim)))
        layer.trim(n)
        return keys.shape

    assert [attended_keys(a) for a in real.cache] == [attended_keys(b) for b in filled.cache]
    block = mx.array([5, 6, 7], mx.uint32)
    assert filled.forward(block).shape == real.forward(block).shape


@pytest.mark.parametrize("costs,expect_drafting", [(FLAT, True), (LINEAR, False)])
def test_auto_gamma_in_the_engine_keeps_output_identical(tiny_target, tiny_draft, costs, expect_drafting):
    prompt = [2] + list(range(40, 60))
    stats = Stats()
    engine = Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB))
    tokens = [t for r in engine.rounds(prompt, gamma=AutoGamma(costs), max_tokens=60, stats=stats) for t in r.tokens]
    assert tokens == greedy_reference(tiny_target, prompt, 60)
    if expect_drafting:
        assert stats.drafted > 60
    else:
        assert stats.drafted == 0  # drafting cannot pay on this curve: no probes either


def test_a_parked_policy_probes_and_resumes_drafting_through_the_engine(tiny_target):
    """Parked after a bad stretch, then the text turns predictable (the target drafting for
    itself: every draft is right). Driven by the real round loop, the policy must probe and
    go back to drafting; probes must not be spent where the engine only asks "plain again?"."""
    policy = AutoGamma(FLAT, probe_every=4)
    for _ in range(40):  # a bad stretch: every draft rejected
        policy.observe(3, 0)
    assert policy.best() == 0  # parked
    stats = Stats()
    engine = Engine(tiny_target, ModelDrafter(tiny_target, TINY_VOCAB))
    prompt = [2] + list(range(40, 60))
    rounds = list(engine.rounds(prompt, gamma=policy, max_tokens=100, stats=stats))
    assert [t for r in rounds for t in r.tokens] == greedy_reference(tiny_target, prompt, 100)
    drafting = [i for i, r in enumerate(rounds) if r.gamma > 0]
    assert drafting and drafting[0] <= 8  # the first probe comes after about probe_every rounds
    assert all(r.gamma > 0 for r in rounds[drafting[0] + 4 : -1])  # and drafting resumed for good
    assert stats.accepted == stats.drafted > 50
