"""Global (full-attention) layers: mlx-lm's `KVCache` with draft-tree masks (`TreeKVCache`),
and its `--kv-bits` twin, which keeps the keys quantized by channel (`ChannelQuantizedKVCache`,
read through `ChannelKeys` by `mlx_spec.cache.attention.channel_attention`)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_spec.cache.layer_base import (
    ExactTrim,
    PackedKV,
    Restorable,
    TreeMask,
    buffer_nbytes,
    kv_slots,
    put_slots,
    slot_capacity,
)


class TreeKVCache(TreeMask, KVCache):
    """mlx-lm's `KVCache`, whose mask can also be a draft tree's (`tree` set)."""

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "ChannelQuantizedKVCache":
        twin = ChannelQuantizedKVCache(group_size, bits)
        if self.keys is not None:  # all of it in the tail: the next write quantizes what is settled
            twin.update_and_fetch(self.keys[..., : self.offset, :], self.values[..., : self.offset, :])
        return twin


class ChannelQuantizedKVCache(ExactTrim, Restorable, TreeMask):
    """A global layer's quantized K/V (`--kv-bits`): values per position as mlx-lm's
    `QuantizedKVCache` holds them, keys per channel (KIVI): Kᵀ [B, heads, head_dim, positions]
    quantized in groups of `group_size` positions, so the scores q @ K run MLX's
    non-transposed quantized matmul (4× faster on x86 CPUs than the transposed one
    mlx-lm's per-position keys need). Positions not yet in a complete group of settled
    positions stay in `tail`, in full precision.

    Exact rollback: a group is quantized from settled positions only (`settled`, which
    `SequenceCache` sets before each forward; None: all held), lazily before the next write, so
    a rejected draft is always in the tail and forgetting it is slicing the tail. A group's
    quantized value depends on its own keys only. Row at position p sees the keys before
    p // group_size * group_size quantized and the rest in full precision, whatever the
    chunking or drafting (`ChannelKeys`)."""

    step = 256  # positions of capacity added at a time (a multiple of every group size)
    settled: Optional[int] = None

    def __init__(self, group_size: int = 64, bits: int = 8):
        self.group_size, self.bits = group_size, bits
        self.keys_t = None  # (packed, scales, biases) of Kᵀ, `quantized` positions used
        self.tail: Optional[mx.array] = None  # [B, heads, offset - quantized, head_dim]
        self.values = None  # (packed, scales, biases) per position, `offset` slots used
        self.offset = 0
        self.quantized = 0  # positions held in keys_t: whole groups

    def _columns(self, positions: int) -> int:
        return positions * self.bits // 32  # packed words of Kᵀ for `positions`

    def _keys_t_held(self) -> tuple:
        groups = self.quantized // self.group_size
        packed, scales, biases = self.keys_t
        return packed[..., : self._columns(self.quantized)], scales[..., :groups], biases[..., :groups]

    def quantize_settled(self) -> None:
        """Quantize the complete groups of settled positions still in the tail."""
        settled = self.offset if self.settled is None else min(self.settled, self.offset)
        n = settled // self.group_size * self.group_size - self.quantized
        if n <= 0:
            return
        new = quantize_by_channel(self.tail[..., :n, :], self.group_size, self.bits)
        capacity = 0 if self.keys_t is None else self.keys_t[1].shape[-1] * self.group_size
        if self.quantized + n > capacity:
            capacity = _rounded_up(self.quantized + n, self.step)
            B, heads, dim = new[0].shape[:3]
            grown = (mx.zeros((B, heads, dim, self._columns(capacity)), mx.uint32),
                     *(mx.zeros((B, heads, dim, capacity // self.group_size), new[1].dtype) for _ in range(2)))
            if self.quantized:
                for a, b in zip(grown, self._keys_t_held()):
                    a[..., : b.shape[-1]] = b
            self.keys_t = grown
        first = (self._columns(self.quantized), self.quantized // self.group_size)
        for a, b, begin in zip(self.keys_t, new, (first[0], first[1], first[1])):
            a[..., begin : begin + b.shape[-1]] = b
        self.quantized += n
        self.tail = self.tail[..., n:, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n_new = keys.shape[2]
        self.quantize_settled()
        if self.values is None or self.offset + n_new > slot_capacity(self.values):
            B, heads, _, dim = values.shape
            per_word, capacity = 32 // self.bits, _rounded_up(self.offset + n_new, self.step)
            grown = (mx.zeros((B, heads, capacity, dim // per_word), mx.uint32),
                     *(mx.zeros((B, heads, capacity, dim // self.group_size), values.dtype) for _ in range(2)))
            if self.offset:
                put_slots(grown, 0, kv_slots(self.values, 0, self.offset))
            self.values = grown
        put_slots(self.values, self.offset, tuple(mx.quantize(values, group_size=self.group_size, bits=self.bits)))
        self.tail = keys if self.tail is None else mx.concatenate([self.tail, keys], axis=2)
        depths = range(n_new) if self.tree is None else (0, *self.tree.depth)
        seen = [(self.offset + d) // self.group_size * self.group_size for d in depths]
        self.offset += n_new
        rows = None  # every row sees the quantized groups held, and the tail in full precision
        if max(seen) > self.quantized:
            if self.tree is not None:  # SequenceCache.draft_room keeps trees inside one group
                raise ValueError("a draft tree crosses a key group of the quantized cache")
            rows = seen
        return self._keys(rows), PackedKV(kv_slots(self.values, 0, self.offset))

    def _keys(self, rows: Optional[list] = None) -> "ChannelKeys":
        held = self._keys_t_held() if self.quantized else ()
        return ChannelKeys(held, self.tail, rows, self.group_size, self.bits)

    def held_kv(self) -> tuple:
        """(keys, values) of every held position, for a layer that reads them (the MTP
        assistant): what a query after them sees."""
        return self._keys(), PackedKV(kv_slots(self.values, 0, self.offset))

    def max_trim(self) -> int:
        return self.offset - self.quantized  # the tail

    def _forget(self) -> None:
        self.tail = self.tail[..., : self.offset - self.quantized, :]

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.values is None

    def row_buffers(self) -> list:
        """(buffers holding one position per slot along axis 2, slots used), for
        `SequenceCache._compact`: unsettled rows are all in the tail."""
        return [((self.tail,), self.offset - self.quantized), (self.values, self.offset)]

    @property
    def state(self):
        """(Kᵀ's quantized groups, the tail, the values), as held."""
        if self.values is None:
            return []
        if self.keys_t is None:  # no group yet: empty arrays of Kᵀ's shape
            B, heads, _, dim = self.tail.shape
            self.keys_t = (mx.zeros((B, heads, dim, 0), mx.uint32),
                           *(mx.zeros((B, heads, dim, 0), self.tail.dtype) for _ in range(2)))
        return self._keys_t_held(), self.tail, kv_slots(self.values, 0, self.offset)

    @state.setter
    def state(self, v):
        self.keys_t, self.tail, self.values = (None, None, None) if not v else v

    @property
    def meta_state(self) -> tuple:
        return tuple(map(str, (self.offset, self.quantized, self.group_size, self.bits)))

    @meta_state.setter
    def meta_state(self, v):
        self.offset, self.quantized, self.group_size, self.bits = map(int, v)
        self.settled, self.tree = None, None

    @property
    def nbytes(self) -> int:
        if self.values is None:
            return 0
        return buffer_nbytes(self.values) + self.tail.nbytes + (0 if self.keys_t is None else buffer_nbytes(self.keys_t))


def _rounded_up(n: int, step: int) -> int:
    return -(-n // step) * step


def quantize_by_channel(keys: mx.array, group_size: int, bits: int) -> tuple:
    """Keys [B, heads, n, head_dim] (n a multiple of group_size) as (packed, scales, biases)
    of Kᵀ: each channel quantized in groups of `group_size` positions."""
    return tuple(mx.quantize(mx.contiguous(keys.swapaxes(-1, -2)), group_size=group_size, bits=bits))


class ChannelKeys(tuple):
    """Keys as `ChannelQuantizedKVCache` hands them to attention (`channel_attention`):
    the quantized Kᵀ triple of the first `quantized` positions (empty before a group is
    complete), then `tail` [B, heads, n, head_dim] in full precision. `rows` (L ints; None: every
    row sees just the triple quantized): the positions each query row sees quantized, where
    a row's group lies past the groups held (a pass crossing a group boundary, or positions
    not yet known settled) and so sees tail groups quantized, as plain decoding would."""

    def __new__(cls, triple: tuple, tail: mx.array, rows: Optional[list], group_size: int, bits: int):
        keys = super().__new__(cls, triple)
        keys.tail, keys.rows, keys.group_size, keys.bits = tail, rows, group_size, bits
        keys.quantized = triple[1].shape[-1] * group_size if triple else 0
        return keys

