"""The γ chooser on synthetic cost curves and acceptance profiles."""

import json
import random

import mlx.core as mx
import pytest
from conftest import greedy_reference

from mlx_spec.apps.calibration import _fill_context, measure_costs
from mlx_spec.cache.sequence import SequenceCache
from mlx_spec.core.cost_model import CostCurve
from mlx_spec.core.engine import Engine
from mlx_spec.core.policy import AutoGamma, GammaPolicy, expected_tokens
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import Drafter, ModelDrafter
from mlx_spec.testing.tiny import TINY_VOCAB

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
    """Every position accepted exactly half the time it is reached: 64 rounds of γ = 6 that
    accept 0, 1, .., 6 tokens 32, 16, 8, 4, 2, 1, 1 times. On FLAT (a verify of γ+1 rows
    1 + 0.02γ, a draft step 0.05) E/T = (2 − 0.5^γ) / (1 + 0.07γ) for γ ≥ 1:
    1.00, 1.402, 1.535, 1.550, 1.514, 1.458, 1.397, so γ = 3."""
    policy = AutoGamma(FLAT, prior_weight=0.01, decay=1.0, learn_costs=False)
    for accepted, times in enumerate([32, 16, 8, 4, 2, 1, 1]):
        for _ in range(times):
            policy.observe(6, accepted)
    assert policy.acceptance() == pytest.approx([0.5] * 6, abs=0.005)
    by_hand = [1.0, 1.402, 1.535, 1.550, 1.514, 1.458, 1.397]
    assert [policy.rate(g) for g in range(7)] == pytest.approx(by_hand, abs=0.01)
    assert policy.best() == 3


def test_falling_acceptance_stops_early():
    # position 3 almost never accepted: drafting it only costs
    policy = trained(FLAT, [0.95, 0.9, 0.05, 0.05, 0.05, 0.05])
    assert policy.best() == 2


def test_compute_bound_costs_probe_only_once_in_max_probe_every_rounds():
    policy = trained(LINEAR, [0.95] * 6)
    assert policy.best() == 0
    assert policy.predicted_speedup(3) < 1.0
    assert not policy.can_pay  # not even a draft that is always right would pay
    chosen = []
    for _ in range(300):
        chosen.append(policy.choose())
        policy.observe(chosen[-1], 0)
    probes = [i for i, g in enumerate(chosen) if g]
    # still probing (so measured round times could overturn the curve), but rarely
    assert probes == [policy.max_probe_every - 1, 2 * policy.max_probe_every - 1]


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
        gamma = policy.choose()
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
    from mlx_spec.core.cost_model import non_decreasing

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
    policy = AutoGamma(costs, learn_costs=False)
    tokens = [t for r in engine.rounds(prompt, gamma=policy, max_tokens=60, stats=stats) for t in r.tokens]
    assert tokens == greedy_reference(tiny_target, prompt, 60)
    if expect_drafting:
        assert stats.drafted > 60
    else:
        assert stats.drafted == 0  # drafting cannot pay on this curve: no probe within 60 rounds


def test_a_parked_policy_probes_and_resumes_drafting_through_the_engine(tiny_target):
    """Parked after a bad stretch, then the text turns predictable (the target drafting for
    itself: every draft is right). Driven by the real round loop, the policy must probe and
    go back to drafting; probes must not be spent where the engine only asks "plain again?"."""
    policy = AutoGamma(FLAT, probe_every=4, learn_costs=False)
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


class Switching(Drafter):
    """A drafter that proposes wrong tokens for its first `bad` drafting rounds, then the
    target's own greedy continuation (the target drafting for itself: always right)."""

    def __init__(self, target, bad: int):
        self.inner = ModelDrafter(target, TINY_VOCAB)
        self.bad, self.rounds = bad, 0
        self.name, self.passes_per_token = "switching", 1

    def begin(self, prompt_ids, cache, processor=None):
        return self.inner.begin(prompt_ids, cache, processor)

    def propose(self, gamma, history, key=None):
        draft = self.inner.propose(gamma, history, key)
        self.rounds += 1
        if self.rounds <= self.bad:  # every token wrong: the first is always rejected
            draft = type(draft)((draft.tokens + 1) % TINY_VOCAB, None)
        return draft

    def accept(self, committed, **kwargs):
        self.inner.accept(committed)


class BadStretchFirst(GammaPolicy):
    """γ = 3 for the first `rounds` rounds (a bad stretch while drafting), then the wrapped
    AutoGamma's choice; the AutoGamma observes every round."""

    def __init__(self, policy: AutoGamma, rounds: int):
        self.policy, self.left = policy, rounds

    def choose(self):
        if self.left > 0:
            self.left -= 1
            return 3
        return self.policy.choose()

    def observe(self, gamma, accepted, seconds=None):
        self.policy.observe(gamma, accepted, seconds)


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
def test_after_a_bad_stretch_two_full_probes_bring_drafting_back_through_the_engine(tiny_target, costs):
    """40 rejected drafting rounds, then every draft right: driven by the real round loop,
    auto γ parks, and drafting resumes after at most two (fully accepted) probes."""
    policy = AutoGamma(costs, learn_costs=False)
    drafter = Switching(tiny_target, bad=40)
    engine = Engine(tiny_target, drafter)
    prompt = [2] + list(range(40, 60))
    rounds = list(engine.rounds(prompt, gamma=BadStretchFirst(policy, 40), max_tokens=200))
    assert [t for r in rounds for t in r.tokens] == greedy_reference(tiny_target, prompt, 200)
    assert all(r.accepted == 0 for r in rounds[:40]) and all(r.gamma == 3 for r in rounds[:40])
    after = rounds[40:]
    drafting = [i for i, r in enumerate(after) if r.gamma > 0]
    assert drafting, "never drafted again"
    # rounds in a row that drafted: a probe is one drafting round between plain ones
    resumed = next(i for i in drafting if i + 1 < len(after) and after[i + 1].gamma > 0)
    probes = sum(1 for i in drafting if i < resumed)
    assert probes <= 1  # the resumed run starts with the second probe, at the latest
    assert all(r.gamma > 0 for r in after[resumed:-1])


def test_live_costs_follow_measured_rounds_and_ignore_one_outlier():
    from mlx_spec.core.cost_model import LiveCosts

    # a calibration made under load: 2.89 steps for a 2-row verify, extended linearly
    loaded = CostCurve(verify=[1.0 + 1.89 * w for w in range(7)], draft_step=0.0, context=256)
    live = LiveCosts(loaded)
    assert live.round_time(1) == pytest.approx(2.89)
    live.observe(1, 1.2)
    assert 1.2 < live.round_time(1) < 2.89  # one round: half-way (in log) from the calibration
    live.observe(1, 1.2)
    assert live.round_time(1) == pytest.approx(1.2)  # two agreeing rounds override it
    assert live.round_time(3) == pytest.approx(loaded.round_time(3) * 1.2 / 2.89)  # unseen γ borrow
    for seconds in (1.2, 1.2, 12.0, 1.2):  # one slow round (another process) moves nothing
        live.observe(1, seconds)
    assert live.round_time(1) == pytest.approx(1.2)
    for _ in range(16):  # a machine that got slower is followed
        live.observe(1, 2.4)
    assert live.round_time(1) == pytest.approx(2.4)


class Clocked:
    """A target whose every forward advances a virtual clock by `cost(width)` seconds; the
    engine reads that clock (perf_counter patched), so measured costs are exact."""

    def __init__(self, model, clock: list, cost):
        self.model, self.clock, self.cost = model, clock, cost

    def __call__(self, inputs, *args, **kwargs):
        self.clock[0] += self.cost(inputs.shape[-1])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_calibration_made_under_load_cannot_park_drafting(tiny_target, monkeypatch):
    """The cached curve says a 2-row verify costs 2.89 steps (measured while another process
    ran); the machine really verifies 7 rows for 1.2 steps. Through the engine, with the
    target drafting for itself (always right): auto γ learns the real costs from its own
    rounds and drafts; taking the curve as given, it never would."""
    import mlx_spec.core.engine

    clock = [0.0]
    monkeypatch.setattr(mlx_spec.core.engine, "perf_counter", lambda: clock[0])
    target = Clocked(tiny_target, clock, lambda width: 1.0 + 0.2 * (width - 1) / 6)
    loaded = CostCurve(verify=[1.0 + 1.89 * w for w in range(7)], draft_step=0.0, context=256)
    prompt = [2] + list(range(40, 60))
    results = {}
    for learn in (False, True):
        engine = Engine(target, ModelDrafter(tiny_target, TINY_VOCAB))  # a free draft: not clocked
        stats = Stats()
        policy = AutoGamma(loaded, learn_costs=learn, max_probe_every=16)
        rounds = list(engine.rounds(prompt, gamma=policy, max_tokens=300, stats=stats))
        assert [t for r in rounds for t in r.tokens] == greedy_reference(tiny_target, prompt, 300)
        results[learn] = stats, rounds
    (given, _), (learned, rounds) = results[False], results[True]
    assert given.drafted <= 300 // 16  # probes only: the curve says it never pays
    assert learned.drafted > 200 and all(r.gamma >= 5 for r in rounds[-10:-1])  # learned: long drafts
    assert learned.decode_time < 0.4 * given.decode_time


def test_auto_gamma_in_a_batch_backs_off_where_rows_cost_compute():
    """Rows free up to a width of 4, then each costs a step (a compute-bound device): alone
    γ = 3 fills the free rows; beside three requests that already fill them, every draft
    row costs a full step of the whole batch's round, and γ drops to plain decoding. Where
    rows stay free (bandwidth-bound), the batch changes nothing."""
    from mlx_spec.core.policy import BatchShare

    for verify, batched_gamma in (([1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0], 0), ([1.0] * 7, None)):
        costs = CostCurve(verify=verify, draft_step=0.0, context=256)
        alone = AutoGamma(costs, max_gamma=6, learn_costs=False).choose()
        share = BatchShare()
        others = [AutoGamma(costs, max_gamma=6, learn_costs=False) for _ in range(3)]
        for other in others:
            share.record(other, 4, 3.439, 0.0)  # γ = 3 at a = 0.9: E = 1 + .9 + .81 + .729
        mine = AutoGamma(costs, max_gamma=6, learn_costs=False, batch=share)
        assert mine.choose() == (alone if batched_gamma is None else batched_gamma)
        assert alone == (3 if verify[4] > 1 else 6)
        assert share.others(others[0])[0] == 2 * 4 + mine.last_choice + 1  # it recorded its row
        share.leave(mine)
        assert share.others(others[0])[0] == 2 * 4


def test_a_request_the_batch_holds_back_drafts_again_once_the_batch_thins():
    """γ = 0 chosen because the others' rows make this request's dear is the batch's choice,
    not evidence against drafting: the request does not park (which would hold it at plain
    decoding for `probe_every` rounds), and drafts as soon as the others leave. Nor does a
    batched request spend rows exploring one position more than the best (its round times
    teach it nothing). Alone, a γ = 0 that is the request's own evidence still parks."""
    from mlx_spec.core.policy import BatchShare

    costs = CostCurve(verify=[1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 4.0], draft_step=0.0, context=256)
    share = BatchShare()
    others = [object() for _ in range(3)]
    for other in others:
        share.record(other, 4, 3.439, 0.0)
    mine = AutoGamma(costs, max_gamma=6, explore_every=1, batch=share)
    assert mine.choose() == 0 and not mine.parked
    mine.observe(0, 0)
    for other in others:
        share.leave(other)
    assert mine.choose() == 3 + 1  # alone now: the free rows, and one more to explore
    share.record(others[0], 7, 6.0, 0.0)
    for _ in range(4):  # batched: never γ + 1 to explore
        assert mine.choose() == mine.best()
        mine.observe(mine.last_choice, mine.last_choice)
    dear = CostCurve(verify=[1.0, 1.9, 2.8, 3.7, 4.6, 5.5, 6.4], draft_step=0.0, context=256)
    lonely = AutoGamma(dear, max_gamma=6, prior=0.1, learn_costs=False)
    assert lonely.choose() == 0 and lonely.parked


def test_batch_widths_are_priced_from_their_measurement_not_the_small_widths_slope():
    """Rows free up to 7 (what one request's verify reaches) but each costing a step at a
    batch's widths (measured at 16 and 64): beside seven requests drafting γ = 6 (49 rows,
    0.9 tokens a row) a request whose drafts are accepted half the time backs off, where
    extending the small widths' flat slope would call every row free."""
    from mlx_spec.core.policy import BatchShare

    costs = CostCurve(verify=[1.0] * 7, draft_step=0.0, context=256, wide=[[16, 16.0], [64, 64.0]])
    assert costs.verify_time(40) == pytest.approx(40.0)  # between measured widths: linear
    assert costs.verify_time(96) == pytest.approx(96.0)  # past the widest: its last slope
    assert CostCurve(verify=[1.0] * 7, draft_step=0.0, context=256).verify_time(64) == 1.0
    share = BatchShare()
    for _ in range(7):
        share.record(object(), 7, 6.3, 0.0)
    for curve, gamma in ((costs, 0), (CostCurve([1.0] * 7, 0.0, 256), 6)):
        assert AutoGamma(curve, max_gamma=6, prior=0.5, learn_costs=False, batch=share).choose() == gamma


def test_batched_calibration_measures_the_batch_widths_and_caches_them(tiny_target, tmp_path, monkeypatch):
    from mlx_spec.apps import calibration as costs_module
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    curve = costs_module.load_or_measure(tiny_target, None, max_width=4, context=32, batch_width=32)
    if len(curve.verify) == 4:  # not stopped early by a noisy first look (then the slope extends)
        assert [w for w, _ in curve.wide] == [16, 32]
        times = [curve.verify[-1]] + [t for _, t in curve.wide]
        assert times == sorted(times) and curve.verify_time(32) == curve.wide[-1][1]
    again = costs_module.load_or_measure(tiny_target, None, max_width=4, context=32, batch_width=32)
    assert again == curve  # read back from the cache, wide widths and all
    table = json.loads(costs_module.cache_path().read_text())
    assert [k for k in table if "|batch32" in k]  # its own entry: a one-request curve is not replaced


def test_a_batchs_curve_is_the_one_request_curve_with_the_batch_widths_on_top(tiny_target, tmp_path, monkeypatch):
    """A request alone in a batch (`serve --parallel N`, one client) must price its rows as
    `--parallel 1` does: the batch's calibration reuses the cached one-request curve and
    times only the wide widths, where measuring widths 1..7 again gave a second, different
    reading of the same rows (and another γ)."""
    from mlx_spec.apps import calibration as costs_module
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    timed = []
    timer = costs_module._forward_timer
    monkeypatch.setattr(costs_module, "_forward_timer", lambda seq, width: timed.append(width) or timer(seq, width))
    alone = costs_module.load_or_measure(tiny_target, None, max_width=4, context=32)
    assert set(timed) == set(range(1, len(alone.verify) + 1))
    timed.clear()
    batched = costs_module.load_or_measure(tiny_target, None, max_width=4, context=32, batch_width=32)
    assert batched.verify == alone.verify and batched.draft_step == alone.draft_step
    assert set(timed) == ({16, 32} if len(alone.verify) == 4 else set())
