"""Global layers' quantized keys by channel (`ChannelQuantizedKVCache`, `--kv-bits`).

Reference for the layout: `mx.fast.scaled_dot_product_attention` on keys dequantized from a
quantization computed here, group by group of positions along each channel (values per
position), a row at position p seeing the keys before p // G * G quantized and the rest in
full precision. Rollback and chunking: the layer fed the same keys either way holds the same
arrays bit for bit.
"""

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_spec.cache.global_layers import ChannelKeys, ChannelQuantizedKVCache
from mlx_spec.cache.layers import KVQuantization
from mlx_spec.cache.sequence import SequenceCache, _fork_layer
from mlx_spec.core.tree import TreeShape
from mlx_spec.testing.tiny import tiny_gemma3

G = 32
D = 64
SCALE = D ** -0.5


def random_kv(n: int, kv_heads: int = 1, seed: int = 0, dim: int = D):
    keys, values = (mx.random.normal((1, kv_heads, n, dim), key=mx.random.key(seed + i)) for i in (0, 1))
    return keys, values


def attend(layer, queries, keys, values):
    """One write and its attention, as mlx-lm's attention layers run it: the layer's mask,
    then mlx-lm's `scaled_dot_product_attention`, which routes quantized K/V to ours."""
    mask = layer.make_mask(keys.shape[2], return_array=True)
    k, v = layer.update_and_fetch(keys, values)
    return mlx_lm_base.scaled_dot_product_attention(queries, k, v, cache=layer, scale=SCALE, mask=mask)


def dequantized(x, bits, axis_positions: bool):
    """x [B, heads, n, D] through an independent quantization: in groups of G positions per
    channel (axis_positions) or of G channels per position (mlx-lm's layout), dequantized."""
    if not axis_positions:
        return mx.dequantize(*mx.quantize(x, group_size=G, bits=bits), group_size=G, bits=bits)
    groups = []
    for first in range(0, x.shape[2], G):
        t = mx.contiguous(x[..., first : first + G, :].swapaxes(-1, -2))  # [B, heads, D, G]
        groups.append(mx.dequantize(*mx.quantize(t, group_size=G, bits=bits), group_size=G, bits=bits).swapaxes(-1, -2))
    return mx.concatenate(groups, axis=2)


def reference(queries, keys, values, first: int, bits: int, keys_by_channel: bool = True):
    """Rows at positions first..first+L-1 over all keys up to each: keys before the row's
    group quantized (by channel, or by position if not keys_by_channel), the rest exact."""
    out = []
    values_seen = dequantized(values, bits, axis_positions=False)
    for row in range(queries.shape[2]):
        p = first + row
        whole = p // G * G
        k = mx.concatenate([dequantized(keys[..., :whole, :], bits, keys_by_channel), keys[..., whole : p + 1, :]],
                           axis=2) if whole else keys[..., : p + 1, :]
        out.append(mx.fast.scaled_dot_product_attention(queries[:, :, row : row + 1], k, values_seen[..., : p + 1, :],
                                                        scale=SCALE))
    return mx.concatenate(out, axis=2)


# (rows written, positions the writer knows settled before the write: None = all held)
WRITES = [(70, None),  # a prefill from empty: two whole groups, but each row sees its own
          (1, None), (1, None),  # decoding, tail partial
          (30, None),  # a pass across the boundary at 96
          (21, None),
          (5, None), (1, -5)]  # a verify pass up to 127, then a queued row at 128 while it is unsettled


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (2, 2)])
def test_attention_is_sdpa_on_keys_quantized_by_channel(bits, heads, kv_heads):
    total = sum(n for n, _ in WRITES)
    keys, values = random_kv(total, kv_heads)
    queries = mx.random.normal((1, heads, total, D), key=mx.random.key(7))
    layer = ChannelQuantizedKVCache(G, bits)
    first = 0
    for n, lag in WRITES:
        layer.settled = None if lag is None else layer.offset + lag
        rows = slice(first, first + n)
        ours = attend(layer, queries[:, :, rows], keys[..., rows, :], values[..., rows, :])
        expected = reference(queries[:, :, rows], keys[..., : first + n, :], values[..., : first + n, :], first, bits)
        np.testing.assert_allclose(np.array(ours), np.array(expected), rtol=1e-4, atol=1e-4)
        wrong_axis = reference(queries[:, :, rows], keys[..., : first + n, :], values[..., : first + n, :], first,
                               bits, keys_by_channel=False)
        if first >= G:  # the check has power: keys quantized by position attend otherwise
            assert np.abs(np.array(ours) - np.array(wrong_axis)).max() > 1e-3
        first += n
    assert layer.quantized == 96 and layer.offset == total == 129  # the queued row's group: not yet settled


def state(layer) -> list:
    return [np.array(a) for _, a in tree_flatten(layer.state)]


def settled(layer) -> ChannelQuantizedKVCache:
    """A copy with the groups its next write would quantize quantized (all it holds settled)."""
    twin = _fork_layer(layer)
    twin.settled = None
    twin.quantize_settled()
    return twin


def assert_same(a, b):
    a, b = settled(a), settled(b)
    sa, sb = state(a), state(b)
    assert (a.offset, a.quantized) == (b.offset, b.quantized) and len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def fed(chunks, keys, values, bits=4, settled=None) -> ChannelQuantizedKVCache:
    layer = ChannelQuantizedKVCache(G, bits)
    first = 0
    for n in chunks:
        layer.settled = settled
        layer.update_and_fetch(keys[..., first : first + n, :], values[..., first : first + n, :])
        first += n
    return layer


def test_a_pass_then_trim_is_as_if_the_rejected_positions_were_never_fed():
    keys, values = random_kv(100)
    after_pass = fed([62], keys, values)
    after_pass.settled = 62
    after_pass.update_and_fetch(keys[..., 62:67, :], values[..., 62:67, :])  # 1 kept + 4 rejected, across 64
    after_pass.trim(4)
    alone = fed([62, 1], keys, values)
    assert_same(after_pass, alone)
    for layer in (after_pass, alone):  # then on alike: the group of 32..63 quantized at the next write
        layer.settled = None
        layer.update_and_fetch(keys[..., 63:100, :], values[..., 63:100, :])
    assert_same(after_pass, alone)
    assert settled(alone).quantized == 96


@pytest.mark.parametrize("breakage", [False, True])
def test_two_unsettled_passes_roll_back_exactly(breakage):
    """A pass, then a queued one before the first is settled, both rolled back: a group is
    quantized from settled positions only. Breakage: a layer told every held position is
    settled quantizes the first pass's draft positions and cannot forget them."""
    keys, values = random_kv(66)
    layer = fed([60], keys, values)
    before = state(settled(layer))
    layer.settled = 60
    layer.update_and_fetch(keys[..., 60:64, :], values[..., 60:64, :])
    layer.settled = None if breakage else 60  # what SequenceCache says: 4 still unsettled
    layer.update_and_fetch(keys[..., 64:66, :], values[..., 64:66, :])
    if breakage:
        with pytest.raises(ValueError, match="cannot roll back 6"):
            layer.trim(6)
        return
    layer.trim(6)
    assert layer.offset == 60 and all(np.array_equal(x, y) for x, y in zip(state(settled(layer)), before))


def test_chunked_prefill_is_one_shot_prefill_bit_for_bit():
    keys, values = random_kv(151)
    one_shot = fed([150], keys, values)
    chunked = fed([1, 31, 40, 3, 75], keys, values)
    assert_same(chunked, one_shot)
    query = mx.random.normal((1, 4, 1, D), key=mx.random.key(9))
    outs = [attend(layer, query, keys[..., 150:, :], values[..., 150:, :]) for layer in (one_shot, chunked)]
    assert np.array_equal(np.array(outs[0]), np.array(outs[1]))


def test_a_group_depends_on_its_own_keys_only():
    """Changing the keys of one group changes no other group's packed words or scales."""
    keys, values = random_kv(129)
    changed = mx.concatenate([keys[..., :64, :], random_kv(32, seed=5)[0], keys[..., 96:, :]], axis=2)
    a, b = fed([128, 1], keys, values), fed([128, 1], changed, values)
    for x, y in zip(a._keys_t_held(), b._keys_t_held()):
        width = x.shape[-1] // 4  # four groups
        x, y = np.array(x), np.array(y)
        assert np.array_equal(x[..., : 2 * width], y[..., : 2 * width])
        assert np.array_equal(x[..., 3 * width :], y[..., 3 * width :])
        assert not np.array_equal(x[..., 2 * width : 3 * width], y[..., 2 * width : 3 * width])


def test_trees_stay_inside_one_key_group():
    model = tiny_gemma3(seed=0)
    cache = SequenceCache(model, 8, kv=KVQuantization(8, G))
    cache.prefill(list(range(2, 60)))
    cache.forward(mx.array([5]))
    cache.settle([5])  # switched: 59 held, 5 more fit in the group of 32..63
    assert cache.draft_room(tree=True) == G - 1 - 59 % G == 4 and cache.draft_room() > 4
    layer = next(c for c in cache.cache if isinstance(c, ChannelQuantizedKVCache))
    layer.tree = TreeShape((-1, 0, 1, 2, 3))  # depth 5: its last row at 64, past the group
    with pytest.raises(ValueError, match="crosses a key group"):
        layer.update_and_fetch(*random_kv(6, model.args.num_key_value_heads, dim=model.args.head_dim))


def test_keys_reach_attention_as_channel_keys_with_their_quantization():
    keys, values = random_kv(40)
    layer = ChannelQuantizedKVCache(G, 8)
    fetched, _ = layer.update_and_fetch(keys, values)
    assert isinstance(fetched, ChannelKeys) and fetched.quantized == 0 and fetched.rows == [p // G * G for p in range(40)]
    fetched, _ = layer.update_and_fetch(keys[..., :1, :], values[..., :1, :])
    assert fetched.quantized == 32 and fetched.rows is None and fetched.tail.shape[2] == 9


def test_prefill_rolls_back_within_the_tail_and_starts_over_past_it():
    """A new conversation reusing part of a quantized cache: a surplus within the global
    layers' tail is rolled back; a deeper one is prefilled again from the start, and the
    cache then holds what a fresh one would, bit for bit."""
    model = tiny_gemma3(seed=0)
    kv = KVQuantization(8, G)
    shared, new = list(range(2, 70)), [7, 8, 9]

    def holding(ids):  # then one decode step, before which the settled groups are quantized
        cache = SequenceCache(model, 8, kv=kv)
        cache.prefill(ids[:-1])
        cache.forward(mx.array(ids[-1:]))
        cache.settle(ids[-1:])
        return cache

    shallow = holding(shared + [100, 101, 102])  # 71 held, quantized through 64: a tail of 7
    assert shallow.max_rollback() == 7 and shallow.prefill(shared + new) == len(new)
    deep = holding(shared + list(range(100, 106)))  # 74 held, a tail of 10
    assert deep.max_rollback() == 10
    ids = shared[:58] + new  # a surplus of 16: below the tail
    assert deep.prefill(ids) == len(ids)  # started over
    fresh = SequenceCache(model, 8, kv=kv)
    fresh.prefill(ids)
    probe = mx.array([11])
    assert np.array_equal(np.array(deep.forward(probe)), np.array(fresh.forward(probe)))
