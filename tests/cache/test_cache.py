"""Exact rollback: after any sequence of speculative writes and partial rollbacks, the
caches give the logits of a model that only ever saw the kept tokens, past the window too."""

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from mlx_spec.cache.global_layers import TreeKVCache
from mlx_spec.cache.sequence import PromptCache, SequenceCache
from mlx_spec.cache.window_layers import WindowKVCache
from mlx_spec.core.engine import Engine
from mlx_spec.drafters import ModelDrafter
from mlx_spec.testing.tiny import TINY_VOCAB

ATOL = 1e-4


def fresh_logits(model, ids):
    """Next-token logits recomputed from scratch with no cache (the window via the mask)."""
    return model(mx.array(ids)[None])[0, -1]


def cached_logits(seq: SequenceCache, token):
    """Next-token logits after `token`, from the cache; the probe is rolled back after."""
    logits = seq.forward(mx.array([token], mx.uint32))[-1]
    mx.eval(logits)
    seq.settle([])
    return logits


def test_sliding_layers_use_the_window_cache(tiny_target):
    seq = SequenceCache(tiny_target, slack=4)
    kinds = [type(c) for c in seq.cache]
    assert kinds == [WindowKVCache, TreeKVCache, WindowKVCache, TreeKVCache]  # TreeKVCache: a KVCache
    assert all(isinstance(c, KVCache) for c in seq.cache[1::2])
    assert seq.rollbackable


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_speculative_writes_and_rollbacks(tiny_target, seed):
    rng = random.Random(seed)
    max_gamma = 6
    seq = SequenceCache(tiny_target, slack=max_gamma + 1)
    seq.prefill([rng.randrange(6, 262) for _ in range(rng.randrange(1, 30))])
    committed = list(seq.ids)
    for _ in range(40):  # ~3-5 wraps of the 16-token window
        block = [rng.randrange(6, 262) for _ in range(rng.randrange(1, max_gamma + 2))]
        mx.eval(seq.forward(mx.array(block, mx.uint32)))
        kept = block[: rng.randrange(0, len(block) + 1)]
        seq.settle(kept)
        committed += kept
        assert seq.ids == committed
        probe = rng.randrange(6, 262)
        expected = fresh_logits(tiny_target, committed + [probe])
        assert mx.allclose(cached_logits(seq, probe), expected, atol=ATOL)
    assert len(committed) > 3 * 16


def test_engine_caches_match_a_model_that_saw_only_committed_tokens(tiny_target, tiny_draft):
    engine = Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB), max_gamma=5)
    cache = engine.make_prompt_cache()
    prompt = [2] + list(range(30, 50))
    committed = list(prompt)
    partial_rounds = 0
    for rnd in engine.rounds(prompt, gamma=5, max_tokens=60, prompt_cache=cache):
        committed += rnd.tokens
        partial_rounds += 0 < rnd.accepted < rnd.gamma
        if rnd.finish_reason:
            break
        # target: holds everything but the last committed token
        assert cache.target.ids == committed[:-1]
        probe = committed[-1]
        assert mx.allclose(cached_logits(cache.target, probe), fresh_logits(tiny_target, committed), atol=ATOL)
        # draft: holds the committed prefix; the drafter still owes it its pending tokens
        drafter = engine.drafter
        assert cache.draft.ids + drafter.pending == committed
        mx.eval(cache.draft.forward(mx.array(drafter.pending, mx.uint32)))
        draft_logits = cache.draft.forward(mx.array([7], mx.uint32))[-1]
        assert mx.allclose(draft_logits, fresh_logits(tiny_draft, committed + [7]), atol=ATOL)
        cache.draft.settle([])
    assert partial_rounds >= 3  # rollbacks of the target and the draft really happened


def test_window_cache_refuses_inexact_rollback(tiny_target):
    seq = SequenceCache(tiny_target, slack=2)
    seq.prefill(list(range(6, 6 + 300)))  # far past the window: old positions dropped
    assert seq.max_rollback() >= 2
    with pytest.raises(ValueError):
        seq.rollback(seq.max_rollback() + 1)


def test_prefill_reuses_the_common_prefix(tiny_target):
    seq = SequenceCache(tiny_target, slack=8)
    assert seq.prefill(list(range(6, 46))) == 40
    assert seq.prefill(list(range(6, 50))) == 4  # extension: only the new tokens
    assert seq.prefill(list(range(6, 44)) + [200, 201]) == 2  # rolled back 6, then 2 new
    expected = fresh_logits(tiny_target, list(range(6, 44)) + [200, 201, 9])
    assert mx.allclose(cached_logits(seq, 9), expected, atol=ATOL)
    assert seq.prefill([6, 7, 8]) == 0  # nothing dropped yet: rolling back is exact
    long = [(5 * i) % 250 + 6 for i in range(1200)]
    seq.prefill(long)  # past the buffer: positions older than window + slack are dropped
    assert seq.cache[0].start > 0
    assert seq.prefill(long[:100]) == 100  # beyond the slack: starts over
    assert seq.ids == long[:100]
    assert mx.allclose(cached_logits(seq, 9), fresh_logits(tiny_target, long[:100] + [9]), atol=ATOL)


class RecurrentTiny:
    """The tiny model with one extra recurrent-state cache (as SSM hybrids have); the
    model ignores it, but its presence makes exact rollback impossible."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def make_cache(self):
        return self.model.make_cache() + [ArraysCache(1)]


def test_unrollbackable_target_falls_back_to_plain_decoding(tiny_target, tiny_draft):
    from conftest import greedy_reference

    target = RecurrentTiny(tiny_target)
    assert not PromptCache(target, slack=4).target.rollbackable
    engine = Engine(target, ModelDrafter(tiny_draft, TINY_VOCAB))
    with pytest.warns(UserWarning, match="cannot roll back"):
        tokens = [t for r in engine.rounds([2, 50, 51, 52], gamma=3, max_tokens=20) for t in r.tokens]
    assert tokens == greedy_reference(tiny_target, [2, 50, 51, 52], 20)
