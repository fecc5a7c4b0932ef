"""A model's cache layers: which ones we make (`make_cache`), when they switch to quantized
K/V (`KVQuantization`), and the reader that hands quantized K/V to a layer that writes none.

Quantized K/V (`--kv-bits`): every cache layer switches to mlx-lm's packed (weights, scales,
biases) layout once its sequence holds `start` tokens (and at least one), checked before
each forward as mlx-lm's `maybe_quantize_kv_cache` checks after one: the same switch points,
so a prompt's first prefill chunk is full precision even with start 0 (`SequenceCache`).
The layers then carry `bits` / `group_size`, so mlx-lm's attention runs on them through
`mx.quantized_matmul` (`mlx_spec.core.cache.attention`). Sliding-window layers quantize positions
one by one (`QuantizedWindowKVCache`); global layers keep their keys by channel
(`ChannelQuantizedKVCache`), which gives the scores MLX's faster non-transposed quantized
matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_spec.core.cache.global_layers import ChannelKeys, ChannelQuantizedKVCache, TreeKVCache
from mlx_spec.core.cache.window_layers import QuantizedWindowKVCache, WindowKVCache


@dataclass(frozen=True)
class KVQuantization:
    """K/V quantization for one model's cache (mlx-lm's kv_bits, kv_group_size and
    quantized_kv_start): every layer switches to `bits` once the sequence holds `start`
    tokens; until then it is full precision."""

    bits: int
    group_size: int = 64
    start: int = 0


class QuantizedKVReader:
    """The `cache` argument for an attention layer that reads K/V another layer quantized
    (Gemma 4's KV-shared layers, the MTP assistant): it writes nothing, and its `bits` make
    mlx-lm's attention use `mx.quantized_matmul` on them."""

    def __init__(self, group_size: int, bits: int, offset: int = 0):
        self.group_size, self.bits, self.offset = group_size, bits, offset

    def update_and_fetch(self, keys, values):
        return keys, values

    @classmethod
    def of(cls, layer) -> Optional["QuantizedKVReader"]:
        """A reader for K/V as `layer` (a cache layer) holds them; None when they are plain."""
        bits = getattr(layer, "bits", None)
        return None if bits is None else cls(layer.group_size, bits, layer.offset)

    @classmethod
    def for_keys(cls, keys, head_dim: int) -> Optional["QuantizedKVReader"]:
        """A reader for `keys` (a plain array: None, or a quantized triple of vectors of
        `head_dim`, whose packed and scale widths tell the bits and group size)."""
        if isinstance(keys, ChannelKeys):
            return cls(keys.group_size, keys.bits)
        if not isinstance(keys, (tuple, list)):
            return None
        packed, scales, _ = keys
        return cls(head_dim // scales.shape[-1], 32 * packed.shape[-1] // head_dim)


def make_cache(model, slack: int) -> list:
    """The model's own per-layer caches, with each sliding-window `RotatingKVCache`
    replaced by a `WindowKVCache` that can roll back `slack` positions, and each plain
    `KVCache` by a `TreeKVCache` (the same, with tree masks)."""
    caches = make_prompt_cache(model)
    return [
        WindowKVCache(c.max_size, slack)
        if isinstance(c, RotatingKVCache) and c.keep == 0
        else TreeKVCache() if type(c) is KVCache and c.empty()
        else c
        for c in caches
    ]


# Our layer classes by name, as cache files record them (mlx-lm's are looked up in mlx-lm).
LAYER_CLASSES = {cls.__name__: cls for cls in (WindowKVCache, QuantizedWindowKVCache, TreeKVCache,
                                               ChannelQuantizedKVCache)}
