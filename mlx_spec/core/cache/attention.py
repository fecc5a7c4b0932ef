"""Attention over our quantized K/V, and the dispatch mlx-lm's attention reaches them by.

mlx-lm's attention calls the module global `mlx_lm.models.base.quantized_scaled_dot_product_attention`
for any cache layer with `bits`; `mlx_spec.runtime` points it at `dispatch_quantized_attention`,
which sends `PackedKV` to `quantized_attention`, `ChannelKeys` to `channel_attention`, and
anything else to mlx-lm's own function.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base

from mlx_spec.core.cache.global_layers import ChannelKeys, quantize_by_channel
from mlx_spec.core.cache.layer_base import PackedKV


def quantized_attention(queries, q_keys, q_values, scale: float, mask, group_size: int = 64, bits: int = 8):
    """mlx-lm's `quantized_scaled_dot_product_attention`, with the query heads that share a
    KV head as rows of one `mx.quantized_matmul` rather than a batch broadcast against the
    packed K/V. The same products in the same order, so the same result bit for bit; MLX's
    CPU kernels copy a broadcast operand first, which cost a copy of every layer's packed
    K and V per query head per step (bench/kv_decode_profile.py)."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads
    if n_repeats == 1:
        return mlx_lm_quantized_attention(queries, q_keys, q_values, scale, mask, group_size, bits)
    rows = (queries * scale).reshape(B, n_kv_heads, n_repeats * L, D)
    scores = mx.quantized_matmul(rows, *q_keys, transpose=True, group_size=group_size, bits=bits)
    return _weighted_values(scores.reshape(B, n_kv_heads, n_repeats, L, -1), q_values, mask, group_size, bits)


def _weighted_values(scores, q_values, mask, group_size: int, bits: int):
    """Attention's second half from scores [B, kv_heads, repeats, L, keys] (mlx-lm's shape,
    for its masks): mask, softmax, then p @ V on the per-position quantized values."""
    B, n_kv_heads, n_repeats, L, _ = scores.shape
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        if mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    scores = mx.softmax(scores, axis=-1, precise=True).reshape(B, n_kv_heads, n_repeats * L, -1)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, n_kv_heads * n_repeats, L, -1)


def channel_attention(queries, keys: ChannelKeys, q_values, scale: float, mask, group_size: int = 64, bits: int = 8):
    """Attention over `ChannelQuantizedKVCache`'s K/V: the scores of the quantized groups by
    `mx.quantized_matmul(q, Kᵀ, transpose=False)`, of the tail by a float matmul (with its
    complete groups quantized for the rows that see them so, `ChannelKeys.rows`), then
    mask, softmax and p @ V as `quantized_attention`. Query heads sharing a KV head are
    rows of one matmul."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys.tail.shape[1]
    n_repeats = n_q_heads // n_kv_heads
    rows = (queries * scale).reshape(B, n_kv_heads, n_repeats * L, D)

    def by_channel(triple):
        return mx.quantized_matmul(rows, *triple, transpose=False, group_size=group_size, bits=bits)

    scores = [rows @ keys.tail.swapaxes(-1, -2)]
    if keys.rows is not None:  # rows that see some of the tail's groups quantized
        n = max(keys.rows) - keys.quantized
        quantized = by_channel(quantize_by_channel(keys.tail[..., :n, :], group_size, bits))
        seen = (keys.quantized + mx.arange(n))[None] < mx.array(keys.rows)[:, None]  # [L, n]
        seen = mx.tile(seen, (n_repeats, 1))  # rows are (repeat, L)
        scores = [mx.where(seen, quantized, scores[0][..., :n]), scores[0][..., n:]]
    if keys.quantized:
        scores.insert(0, by_channel(keys))
    scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    return _weighted_values(scores.reshape(B, n_kv_heads, n_repeats, L, -1), q_values, mask, group_size, bits)


def dispatch_quantized_attention(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
    """What mlx-lm's attention calls for every quantized cache once `mlx_spec.runtime` has
    routed its module global here: our layers' K/V take our kernels, anything else (mlx-lm's
    own QuantizedKVCache) runs mlx-lm's function."""
    attention = (channel_attention if isinstance(q_keys, ChannelKeys) else
                 quantized_attention if isinstance(q_keys, PackedKV) else mlx_lm_quantized_attention)
    return attention(queries, q_keys, q_values, scale, mask, group_size, bits)


# mlx-lm's own function, also when this module is imported again after the routing
mlx_lm_quantized_attention = getattr(mlx_lm_base.quantized_scaled_dot_product_attention, "mlx_lm",
                                     mlx_lm_base.quantized_scaled_dot_product_attention)
dispatch_quantized_attention.mlx_lm = mlx_lm_quantized_attention
