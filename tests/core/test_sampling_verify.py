"""Unit checks of the sampling processor and the acceptance rule on hand-made vectors."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.core.sampling import LogitProcessor, SamplingParams
from mlx_spec.core.verify import verify_greedy, verify_sampled
from mlx_spec.errors import MlxSpecError


def dist(logits, **params):
    processor = LogitProcessor(SamplingParams(**params))
    return processor.distribution(mx.array([logits]))[0].tolist()


def test_temperature_only_is_softmax():
    probs = dist([0.0, math.log(3.0)], temperature=1.0)
    assert probs == pytest.approx([0.25, 0.75])
    sharper = dist([0.0, math.log(3.0)], temperature=0.5)
    assert sharper == pytest.approx([0.1, 0.9])


def test_top_k_top_p_min_p():
    logits = [math.log(p) for p in (0.5, 0.2, 0.15, 0.1, 0.05)]
    assert dist(logits, temperature=1.0, top_k=2) == pytest.approx([5 / 7, 2 / 7, 0, 0, 0])
    # top-p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is kept to carry the mass past 0.8
    assert dist(logits, temperature=1.0, top_p=0.8) == pytest.approx([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])
    # min-p 0.3: keep p >= 0.15
    assert dist(logits, temperature=1.0, min_p=0.3) == pytest.approx([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])


def test_repetition_penalty_windows_follow_the_block():
    processor = LogitProcessor(SamplingParams(temperature=1.0, repetition_penalty=2.0, repetition_context=2))
    history = [1, 2]
    block = mx.array([3, 4], mx.uint32)
    windows = processor.windows(history, block, 3)
    # row i sees the last two tokens of history + block[:i]
    assert windows.tolist() == [[1, 2], [2, 3], [3, 4]]
    assert processor.windows(history, block, 3, first=2).tolist() == [[3, 4]]
    logits = mx.array([[1.0, 1.0, -1.0, 1.0, 1.0]])
    penalized = processor.penalize(logits, processor.windows([1, 2], None, 1))
    assert penalized.tolist() == [[1.0, 0.5, -2.0, 1.0, 1.0]]


def test_greedy_ignores_filters():
    processor = LogitProcessor(SamplingParams(temperature=0, top_k=1, top_p=0.1))
    assert processor.greedy(mx.array([[0.1, 0.3, 0.2]])).tolist() == [1]


@pytest.mark.parametrize(
    "bad",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=1), dict(top_k=-2), dict(repetition_penalty=0),
     dict(seed=-1), dict(seed=2**64)],
)
def test_bad_parameters_are_one_line_errors(bad):
    with pytest.raises(MlxSpecError):
        SamplingParams(**bad)


def test_greedy_verification():
    def verdict(x, target_tokens):
        n, token = verify_greedy(mx.array(x, mx.uint32), mx.array(target_tokens))
        return n.item(), token.item()

    x = [5, 6, 7]
    assert verdict(x, [5, 6, 9, 1]) == (2, 9)
    assert verdict(x, [5, 6, 7, 1]) == (3, 1)  # bonus
    assert verdict(x, [4, 6, 7, 1]) == (0, 4)
    assert verdict([], [8]) == (0, 8)


def test_leviathan_rule_emits_p_and_accepts_min_p_q():
    """Many rounds with fixed p and q: the first emitted token is distributed as p_1, and
    x_1 is accepted with probability Σ min(p_1, q_1) (the paper's α for this position)."""
    p = mx.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = mx.array([[0.2, 0.2, 0.3, 0.3], [0.7, 0.1, 0.1, 0.1]])
    draws, first, accepted = 6000, [0] * 4, 0
    keys = mx.random.split(mx.random.key(0), draws)
    for i in range(draws):
        k_draft, k_verify = mx.random.split(keys[i])
        x = mx.random.categorical(mx.log(q), key=k_draft).astype(mx.uint32)
        n, token = verify_sampled(x, q, p, k_verify)
        n = n.item()
        first[x[0].item() if n > 0 else token.item()] += 1
        accepted += n > 0
    alpha = sum(min(a, b) for a, b in zip(p[0].tolist(), q[0].tolist()))  # 0.7
    sd = math.sqrt(alpha * (1 - alpha) / draws)
    assert abs(accepted / draws - alpha) < 4 * sd
    for count, prob in zip(first, p[0].tolist()):
        assert abs(count / draws - prob) < 4 * math.sqrt(max(prob * (1 - prob), 1e-9) / draws) + 1e-9
    assert first[3] == 0  # p = 0 is never emitted, though q proposes it


def test_one_hot_draft_accepts_with_probability_p():
    p = mx.array([[0.6, 0.4], [0.5, 0.5]])
    x = mx.array([1], mx.uint32)
    draws, accepted, recovered = 3000, 0, [0, 0]
    keys = mx.random.split(mx.random.key(1), draws)
    for i in range(draws):
        n, token = verify_sampled(x, None, p, keys[i])
        if n.item():
            accepted += 1
        else:
            recovered[token.item()] += 1
    assert abs(accepted / draws - 0.4) < 4 * math.sqrt(0.24 / draws)
    assert recovered[1] == 0  # the residual excludes the rejected token


@pytest.mark.parametrize("temperature", [0.7, 5.0])  # peaked: head path; flat: full-sort path
def test_top_p_on_a_large_vocabulary_matches_a_full_sort(temperature):
    logits = mx.random.normal((3, 50_000), key=mx.random.key(3)) * 4
    params = SamplingParams(temperature=temperature, top_p=0.9)
    processor = LogitProcessor(params)
    fast = processor.distribution(logits)
    processor.nucleus_head = logits.shape[-1]  # always sort everything
    full = processor.distribution(logits)
    assert mx.array_equal(fast > 0, full > 0)
    assert mx.allclose(fast, full, atol=1e-7)


def test_penalty_windows_see_all_history_and_ignore_ids_past_the_vocabulary():
    """Row i penalizes the last C tokens of history + block[:i], however short the history;
    ids the logits lack (a narrower draft vocabulary) are skipped, never gathered."""
    processor = LogitProcessor(SamplingParams(repetition_penalty=2.0, repetition_context=64))
    windows = processor.windows([1, 2], mx.array([3, 9], mx.uint32), rows=3)
    logits = mx.array([[4.0, 4.0, 4.0, 4.0, -4.0, 4.0]] * 3)
    expected = np.array([[4.0, 4.0, 4.0, 4.0, -4.0, 4.0]] * 3)
    for row, seen in enumerate([[1, 2], [1, 2, 3], [1, 2, 3]]):  # 9 is past the 6 columns
        expected[row, seen] = [v / 2.0 if v > 0 else v * 2.0 for v in expected[row, seen]]
    assert np.array_equal(np.array(processor.penalize(logits, windows)), expected)
