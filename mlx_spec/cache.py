"""Both models' KV caches, and exact rollback.

Speculation writes γ+1 positions into the target's cache and keeps only the accepted ones,
so every layer must be able to forget its last few positions exactly. mlx-lm's plain
`KVCache` can. Its `RotatingKVCache` (Gemma's sliding-window layers) cannot once it has
wrapped: the slots a rejected draft overwrote held the oldest positions of the window, which
the next query still needs. We replace it with `WindowKVCache`, which keeps `slack` positions
more than the window needs and enforces the window through the attention mask, so a
rollback of up to `slack` positions is exact at any context length.

A draft tree (`mlx_spec.tree`) is verified in one pass too: while `SequenceCache.forward`
feeds one, every layer's mask shows each row the prefix and its ancestors only, and RoPE
puts each row at prefix + depth; `settle(kept, rows=...)` then moves the accepted rows' K/V
into place before the rest is rolled back.

Quantized K/V (`KVQuantization`, `--kv-bits`): every cache layer switches to mlx-lm's
packed (weights, scales, biases) layout once its sequence holds `start` tokens (and at
least one), checked before each forward as mlx-lm's `maybe_quantize_kv_cache` checks after
one: the same switch points, so a prompt's first prefill chunk is full precision even with
start 0. The layers then carry `bits` / `group_size`, so mlx-lm's attention runs on them
through `mx.quantized_matmul`; they hand it their K/V as `PackedKV`, for which the module
global mlx-lm's attention calls, routed by `mlx_spec.runtime`, runs `quantized_attention` (the
same result, without copying the packed arrays per query head; anything else still runs
mlx-lm's own).
Sliding-window layers quantize positions one by one (a group lies along head_dim), so
trimming the packed arrays is as exact as trimming plain ones. Global layers keep their keys
by channel (`ChannelQuantizedKVCache`: groups of positions, quantized once settled, the rest
in a full-precision tail; `ChannelKeys` reach `channel_attention`), which gives the scores
MLX's faster non-transposed quantized matmul. A verify pass never straddles the switch
(`draft_room`): each row sees keys of the precision plain decoding would have given it.

Caches with recurrent state (SSM / linear-attention layers) cannot roll back at all;
`SequenceCache.rollbackable` says so and the engine then decodes without drafting.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base as mlx_lm_base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (KVCache, QuantizedKVCache, RotatingKVCache, create_attention_mask,
                                 make_prompt_cache)
from mlx.utils import tree_map

from mlx_spec import blas
from mlx_spec.tree import TreeShape, tree_mask


class _TreeMask:
    """A plain cache's mask, or a draft tree's while `tree` is set."""

    tree: Optional[TreeShape] = None

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if self.tree is not None:
            return tree_mask(self.tree, self.offset, window_size)
        return create_attention_mask(N, self.offset, return_array, window_size)


class _ExactTrim:
    """Rollback of up to `max_trim()` positions; more is refused."""

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n > self.max_trim():
            raise ValueError(f"cannot roll back {n} positions exactly (at most {self.max_trim()})")
        self.offset -= n
        self._forget()
        return n

    def _forget(self) -> None:
        """Drop what the trimmed positions held (the next write overwrites their slots)."""


class _Restorable:
    """mlx-lm's cache serialisation protocol: arrays in `state`, scalars (as strings) in
    `meta_state`, and `from_state(state, meta_state)` builds the cache again."""

    @classmethod
    def from_state(cls, state, meta_state):
        obj = cls.__new__(cls)
        obj.meta_state, obj.state = meta_state, state
        return obj


MAX_ROOM = 1 << 30  # no limit on a verify pass's draft tokens


class WindowKVCache(_ExactTrim, _Restorable):
    """A sliding-window KV cache that can roll back up to `slack` positions exactly.

    Keys and values are stored in temporal order; positions older than
    `window - 1 + slack` behind the newest are dropped in batches (every `step` tokens),
    and `make_mask` hides keys outside each query's window. Drop-in for mlx-lm's
    `RotatingKVCache(max_size=window, keep=0)`.

    While `image_blocks` is set ([N]: each fed row's image, or -1), a prefill's rows of one
    image also see that image's later rows, within the window (Gemma 4's bidirectional
    images, on sliding-window layers only, as transformers and Google's reference have it).
    """

    step = 256
    image_blocks: Optional[mx.array] = None

    def __init__(self, window: int, slack: int):
        self.window = window
        self.slack = slack
        self.keys: Optional[mx.array] = None  # [B, heads, capacity, head_dim]
        self.values: Optional[mx.array] = None
        self.offset = 0  # absolute position of the next token (RoPE reads it)
        self.start = 0  # absolute position stored in slot 0
        self.tree: Optional[TreeShape] = None  # set while a draft tree is fed

    @property
    def retain(self) -> int:
        """Past positions kept: what the next query's window needs, plus the slack."""
        return self.window - 1 + self.slack

    def _start_after(self, n_new: int) -> int:
        # Where slot 0 will point once n_new positions are written; make_mask must agree
        # with update_and_fetch, so both call this.
        capacity = 0 if self.keys is None else _length(self.keys)
        if self.offset - self.start + n_new <= capacity:
            return self.start
        return max(self.start, self.offset - self.retain)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n_new = keys.shape[2]
        used = self.offset - self.start
        if self.keys is None or used + n_new > _length(self.keys):
            new_start = self._start_after(n_new)
            kept = used - (new_start - self.start)
            B, heads, _, k_dim = keys.shape
            capacity = kept + n_new + self.step
            new_keys = self._empty((B, heads, capacity), k_dim, keys.dtype)
            new_values = self._empty((B, heads, capacity), values.shape[3], values.dtype)
            if kept > 0:
                _put(new_keys, 0, kv_slots(self.keys, used - kept, used))
                _put(new_values, 0, kv_slots(self.values, used - kept, used))
            self.keys, self.values, self.start, used = new_keys, new_values, new_start, kept
        _put(self.keys, used, self._pack(keys))
        _put(self.values, used, self._pack(values))
        self.offset += n_new
        # Return only what the new queries can see: window - 1 keys before them, at most
        # (the slack is kept for rollback, not attended to).
        first = used - min(used, self.window - 1)
        return kv_slots(self.keys, first, used + n_new), kv_slots(self.values, first, used + n_new)

    def _empty(self, shape: tuple, dim: int, dtype) -> mx.array:
        return mx.zeros((*shape, dim), dtype)

    def _pack(self, x: mx.array) -> mx.array:
        return x

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "QuantizedWindowKVCache":
        twin = QuantizedWindowKVCache(self.window, self.slack, group_size, bits)
        twin.offset, twin.start = self.offset, self.start
        if self.keys is not None:
            twin.keys, twin.values = twin._pack(self.keys), twin._pack(self.values)
        return twin

    def keys_seen(self, N: int) -> int:
        """Keys update_and_fetch will return for N new positions (the mask's width)."""
        return min(self.offset - self._start_after(N), self.window - 1) + N

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        window = window_size or self.window
        prior = self.keys_seen(N) - N  # keys returned before the new ones
        if self.tree is not None:
            return tree_mask(self.tree, prior, window)
        if self.image_blocks is not None:
            return _open_images(create_causal_mask(N, prior, window_size=window), self.image_blocks, window)
        if prior + N <= window:  # every query sees every returned key: plain causal
            if N == 1:
                return None
            return create_causal_mask(N, prior) if return_array else "causal"
        return create_causal_mask(N, prior, window_size=window)

    def max_trim(self) -> int:
        """Positions that can be forgotten while the next query still finds its full window."""
        if self.start == 0:
            return self.offset
        return max(0, self.offset - self.start - (self.window - 1))

    def size(self) -> int:
        return self.offset - self.start

    def empty(self) -> bool:
        return self.keys is None

    # mlx-lm's serialisation protocol (`_Restorable`): arrays in `state`, scalars in `meta_state`
    @property
    def state(self):
        """The K/V slots held (quantized triples in `QuantizedWindowKVCache`)."""
        used = self.offset - self.start
        if self.keys is None:
            return []
        return kv_slots(self.keys, 0, used), kv_slots(self.values, 0, used)

    @state.setter
    def state(self, v):
        self.keys, self.values = (None, None) if not v else v

    @property
    def meta_state(self) -> tuple:
        return tuple(map(str, (self.window, self.slack, self.offset, self.start)))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.slack, self.offset, self.start = map(int, v)
        self.tree = None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else _nbytes(self.keys) + _nbytes(self.values)


def _open_images(mask: mx.array, blocks: mx.array, window: int) -> mx.array:
    """`mask` [N, prior + N] with each of the N new rows also seeing the new rows of its own
    image (`blocks` [N]: the row's image, or -1) less than `window` before it."""
    N = blocks.shape[0]
    rows = mx.arange(N)
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    same = same & (rows[:, None] - rows[None, :] < window)
    prior = mask.shape[-1] - N
    return mx.concatenate([mask[:, :prior], mask[:, prior:] | same], axis=1)


class _PackedFetch:
    """A quantized cache layer whose K/V reach attention as `PackedKV`."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return tuple(map(PackedKV, super().update_and_fetch(keys, values)))


class QuantizedWindowKVCache(_PackedFetch, WindowKVCache):
    """`WindowKVCache` holding K/V in mlx-lm's quantized layout ((packed, scales, biases),
    as `QuantizedKVCache`); `bits` makes mlx-lm's attention use `mx.quantized_matmul`.
    mlx-lm's own `RotatingKVCache` cannot be quantized ("Quantization NYI",
    ml-explore/mlx-lm#1573)."""

    def __init__(self, window: int, slack: int, group_size: int = 64, bits: int = 8):
        super().__init__(window, slack)
        self.group_size, self.bits = group_size, bits

    def _empty(self, shape: tuple, dim: int, dtype) -> tuple:
        per_word = 32 // self.bits
        return (mx.zeros((*shape, dim // per_word), mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype),
                mx.zeros((*shape, dim // self.group_size), dtype))

    def _pack(self, x: mx.array) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "QuantizedWindowKVCache":
        # already quantized (mlx-lm's maybe_quantize_kv_cache asks every layer after each step)
        if (group_size, bits) != (self.group_size, self.bits):
            raise ValueError(f"the cache is quantized to {self.bits} bits in groups of {self.group_size}")
        return self

    @property
    def meta_state(self) -> tuple:  # `WindowKVCache`'s, with the quantization
        return tuple(map(str, (self.window, self.slack, self.group_size, self.bits, self.offset, self.start)))

    @meta_state.setter
    def meta_state(self, v):
        self.window, self.slack, self.group_size, self.bits, self.offset, self.start = map(int, v)
        self.tree = None


class TreeKVCache(_TreeMask, KVCache):
    """mlx-lm's `KVCache`, whose mask can also be a draft tree's (`tree` set)."""

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "ChannelQuantizedKVCache":
        twin = ChannelQuantizedKVCache(group_size, bits)
        if self.keys is not None:  # all of it in the tail: the next write quantizes what is settled
            twin.update_and_fetch(self.keys[..., : self.offset, :], self.values[..., : self.offset, :])
        return twin


class ChannelQuantizedKVCache(_ExactTrim, _Restorable, _TreeMask):
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
        if self.values is None or self.offset + n_new > _length(self.values):
            B, heads, _, dim = values.shape
            per_word, capacity = 32 // self.bits, _rounded_up(self.offset + n_new, self.step)
            grown = (mx.zeros((B, heads, capacity, dim // per_word), mx.uint32),
                     *(mx.zeros((B, heads, capacity, dim // self.group_size), values.dtype) for _ in range(2)))
            if self.offset:
                _put(grown, 0, kv_slots(self.values, 0, self.offset))
            self.values = grown
        _put(self.values, self.offset, tuple(mx.quantize(values, group_size=self.group_size, bits=self.bits)))
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
        return _nbytes(self.values) + self.tail.nbytes + (0 if self.keys_t is None else _nbytes(self.keys_t))


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


def kv_slots(x, first: int, end: int):
    """Slots [first, end) of a K or V buffer (an array, or a quantized triple)."""
    return tree_map(lambda a: a[..., first:end, :], x)


def _put(x, first: int, new) -> None:
    """Write `new` into the slots from `first` on, in place (component by component)."""
    for a, b in zip(_parts(x), _parts(new)):
        a[..., first : first + b.shape[2], :] = b


def _parts(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _length(x) -> int:
    return _parts(x)[0].shape[2]


def _nbytes(x) -> int:
    return sum(a.nbytes for a in _parts(x))


class PackedKV(tuple):
    """A quantized (packed, scales, biases) K or V as our caches return it to attention,
    which then runs `quantized_attention`."""


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
        return _mlx_lm_quantized_attention(queries, q_keys, q_values, scale, mask, group_size, bits)
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
                 quantized_attention if isinstance(q_keys, PackedKV) else _mlx_lm_quantized_attention)
    return attention(queries, q_keys, q_values, scale, mask, group_size, bits)


# mlx-lm's own function, also when this module is imported again after the routing
_mlx_lm_quantized_attention = getattr(mlx_lm_base.quantized_scaled_dot_product_attention, "mlx_lm",
                                      mlx_lm_base.quantized_scaled_dot_product_attention)
dispatch_quantized_attention.mlx_lm = _mlx_lm_quantized_attention


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


class _PositionedRoPE(nn.Module):
    """An attention layer's own RoPE, applied at one given position per row (mlx-lm's
    attention passes the cache offset, a position for the first row only). Rows become
    the batch axis, where MLX's rope takes a vector of offsets."""

    def __init__(self, rope, positions: mx.array):
        super().__init__()
        self.inner, self.positions = rope, positions

    def __call__(self, x: mx.array, offset=None) -> mx.array:
        B, H, L, D = x.shape
        rows = x.transpose(2, 0, 1, 3).reshape(L, B * H, 1, D)
        return self.inner(rows, offset=self.positions).reshape(L, B, H, D).transpose(1, 2, 0, 3)


def attention_layers(model) -> list:
    lm = getattr(model, "language_model", model)
    return [getattr(layer, "self_attn", None) for layer in lm.layers]


def tree_capable(model, cache: list) -> bool:
    """Whether a draft tree can be fed: every cache layer is ours (tree masks, compaction)
    and every attention layer has a `rope` to position by depth."""
    layers = attention_layers(model)
    return (all(isinstance(c, (TreeKVCache, ChannelQuantizedKVCache, WindowKVCache)) for c in cache)
            and all(a is not None and isinstance(getattr(a, "rope", None), nn.Module) for a in layers))


@contextmanager
def ropes_replaced(model, positioned: Callable):
    """While the model's graph is built, each attention layer's RoPE is `positioned(rope)`.
    (MLX is lazy: the graph keeps them once the call returns.)"""
    layers = attention_layers(model)
    ropes = [a.rope for a in layers]
    try:
        for attention, rope in zip(layers, ropes):
            attention.rope = positioned(rope)
        yield
    finally:
        for attention, rope in zip(layers, ropes):
            attention.rope = rope


@contextmanager
def _feeding_tree(model, cache: list, shape: TreeShape, root: int):
    """While the model's graph is built: tree masks in every cache layer, and each row's
    RoPE at root + depth."""
    positions = mx.array([root, *(root + d for d in shape.depth)], mx.int32)
    try:
        for layer in cache:
            layer.tree = shape
        with ropes_replaced(model, lambda rope: _PositionedRoPE(rope, positions)):
            yield
    finally:
        for layer in cache:
            layer.tree = None


@contextmanager
def _images_opened(cache: list, blocks: Optional[mx.array]):
    """While the model's graph is built: the sliding-window layers' masks open each image's
    rows to each other (`WindowKVCache.image_blocks`); nothing when `blocks` is None."""
    windows = [layer for layer in cache if isinstance(layer, WindowKVCache)] if blocks is not None else []
    try:
        for layer in windows:
            layer.image_blocks = blocks
        yield
    finally:
        for layer in windows:
            layer.image_blocks = None


def _max_trim(layer) -> int:
    if isinstance(layer, (WindowKVCache, ChannelQuantizedKVCache)):
        return layer.max_trim()
    if isinstance(layer, (KVCache, QuantizedKVCache)):
        return layer.offset
    return 0  # recurrent state or an overwriting ring: no exact rollback


def final_hidden(model, inputs: mx.array, cache, **embedded) -> mx.array:
    """The decoder's final (post-norm) hidden states, without the LM head: mlx-lm's
    Gemma-family models are a decoder `model.model` ending in its final norm. `embedded`:
    `input_embeddings` for the rows (an image prompt's, `mlx_spec.vision`)."""
    lm = getattr(model, "language_model", model)  # multimodal wrappers hold the text model
    return lm.model(inputs, cache=cache, **embedded)


def logits_and_hidden(model, inputs: mx.array, cache, **embedded) -> tuple[mx.array, mx.array]:
    """One forward that also returns the final (post-norm) hidden states, for drafters that
    read them: the decoder (`final_hidden`), then a tied embedding or an `lm_head`, then an
    optional logit soft-cap."""
    lm = getattr(model, "language_model", model)
    hidden = final_hidden(model, inputs, cache, **embedded)
    if getattr(lm, "tie_word_embeddings", not hasattr(lm, "lm_head")):
        logits = lm.model.embed_tokens.as_linear(hidden)
    else:
        logits = lm.lm_head(hidden)
    cap = getattr(lm, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits, hidden


def forward_model(model, tokens: mx.array, cache, hidden: bool = False, head: bool = True, **embedded):
    """The model over tokens [B, L]: logits; with hidden=True (logits, final hidden states);
    with head=False the final hidden states only. `embedded`: `input_embeddings` for the
    rows (an image prompt's)."""
    if not head:
        return final_hidden(model, tokens, cache, **embedded)
    if hidden:
        return logits_and_hidden(model, tokens, cache, **embedded)
    return model(tokens, cache=cache, **embedded)


class SequenceCache:
    """One model, its per-layer cache, and the token ids that cache holds.

    `ids` is what the cache holds once a round is settled: token ids, and where an image
    prompt put image tokens, (id, image hash) keys (`mlx_spec.vision.ImagePrompt.keys`). Tokens fed with `forward` during
    a round (draft tokens, still lazy on the device) are unsettled until `settle(kept)`
    keeps a prefix of them and rolls the rest back.

    `vocab`: the model's embedding rows, when ids it lacks can reach it (a draft narrower
    than the target); such ids are fed as id 0 (MLX does not bounds-check gathers). `ids`
    keeps the real ids, so prefix reuse still compares what was said.

    `kv`: quantize the K/V (see the module docstring), or None for full precision.
    """

    def __init__(self, model, slack: int, vocab: Optional[int] = None,
                 kv: Optional[KVQuantization] = None):
        self.model = model
        self.slack = slack
        self.vocab = vocab
        self.kv = kv
        self.cache = make_cache(model, slack)
        self.ids: list[int] = []
        self.unsettled = 0
        # [1, 1, H] final hidden state at the last position the latest prefill fed, when it
        # was asked for one (hidden=True) and fed anything; None once the cache moves on.
        self.prefill_hidden: Optional[mx.array] = None

    @property
    def rollbackable(self) -> bool:
        """Whether every layer can forget positions exactly (plain/windowed KV only)."""
        return all(isinstance(c, (KVCache, QuantizedKVCache, WindowKVCache, ChannelQuantizedKVCache))
                   for c in self.cache)

    @property
    def offset(self) -> int:
        """Positions the cache holds, unsettled ones included."""
        return self.cache[0].offset if self.cache else 0

    @property
    def quantized(self) -> bool:
        return any(hasattr(c, "bits") for c in self.cache)

    def _switch(self) -> int:
        # mlx-lm checks after a forward, so an empty cache's first forward is never quantized
        return max(self.kv.start, 1)

    def draft_room(self, tree: bool = False) -> int:
        """The most draft tokens the next verify pass (from position `offset`) may carry
        without straddling the switch to quantized K/V: rows before the switch must see
        full-precision keys, rows after it quantized ones, as in plain decoding. A `tree`
        also stays inside the key group its root is in (`ChannelQuantizedKVCache`: a
        group's keys would mix the tree's branches)."""
        if self.kv is None:
            return MAX_ROOM
        if not self.quantized and self.offset < self._switch():
            return self._switch() - 1 - self.offset
        if tree and any(isinstance(c, (TreeKVCache, ChannelQuantizedKVCache)) for c in self.cache):
            return self.kv.group_size - 1 - self.offset % self.kv.group_size
        return MAX_ROOM

    def _quantize_when_due(self) -> None:
        # Before a forward, as mlx-lm's maybe_quantize_kv_cache after the previous one; and
        # the layers that quantize keys by group learn which positions are settled.
        if self.kv is not None and not self.quantized and self.offset >= self._switch():
            self.cache = [c.to_quantized(group_size=self.kv.group_size, bits=self.kv.bits)
                          if hasattr(c, "to_quantized") else c for c in self.cache]
        for layer in self.cache:
            if isinstance(layer, ChannelQuantizedKVCache):
                layer.settled = self.offset - self.unsettled
                layer.quantize_settled()  # now rather than at the write: the same positions

    def max_rollback(self) -> int:
        return min((_max_trim(c) for c in self.cache), default=0)

    def reset(self) -> None:
        self.cache = make_cache(self.model, self.slack)
        self.ids = []
        self.unsettled = 0
        self.prefill_hidden = None

    @property
    def tree_capable(self) -> bool:
        return tree_capable(self.model, self.cache)

    @property
    def batchable(self) -> bool:
        """Whether a batch may feed it beside other rows (`mlx_spec.batch`): what a tree
        needs, and K/V that never switch to quantized (a batch's forward skips the switch
        `forward` makes, and cannot stack packed triples)."""
        return self.tree_capable and self.kv is None

    def fed_ids(self, tokens: mx.array) -> mx.array:
        """`tokens` as fed to the model: ids past its embedding (`vocab`) become 0."""
        return tokens if self.vocab is None else mx.where(tokens < self.vocab, tokens, 0)

    def forget_padding(self, n: int) -> None:
        """Forget the last n positions just fed: a batch's padding after this row's block."""
        self._trim(n)

    def forward(self, tokens: mx.array, hidden: bool = False, tree: Optional[TreeShape] = None):
        """Feed `tokens` ([n] int) and return logits [n, V], lazily; with hidden=True,
        (logits [n, V], final hidden states [n, H]). With a `tree`, tokens are its
        flattened block [root, x_0..x_N-1] (see `mlx_spec.tree`), fed in one pass."""
        self._quantize_when_due()
        if tree is not None:
            root = self.cache[0].offset  # the root's position: every layer agrees
            with _feeding_tree(self.model, self.cache, tree, root):
                return self.forward(tokens, hidden)
        self.unsettled += tokens.shape[0]
        self.prefill_hidden = None
        out = self._call(tokens[None], hidden)
        return (out[0][0], out[1][0]) if hidden else out[0]

    def fork(self) -> "SequenceCache":
        """A copy holding the same ids, which then moves independently of this one. The
        arrays are shared until either side writes (MLX copies a shared buffer on write)."""
        if self.unsettled:
            self.settle([])
        twin = copy.copy(self)
        twin.cache = [_fork_layer(layer) for layer in self.cache]
        twin.ids = list(self.ids)
        twin.prefill_hidden = None
        return twin

    @property
    def nbytes(self) -> int:
        return sum(getattr(layer, "nbytes", 0) for layer in self.cache)

    def _call(self, tokens: mx.array, hidden: bool = False, head: bool = True, **embedded):
        """Logits; with hidden=True (logits, final hidden states); with head=False the final
        hidden states only. `embedded`: input embeddings for the rows (`final_hidden`)."""
        tokens = self.fed_ids(tokens)
        cache = self.cache
        if self.quantized:  # Gemma 4's KV-shared layers (no cache of their own) read quantized K/V
            shared = len(getattr(self.model, "language_model", self.model).layers) - len(cache)
            cache = cache + [QuantizedKVReader.of(cache[0])] * shared
        try:
            return forward_model(self.model, tokens, cache, hidden, head, **embedded)
        except BaseException:
            # Interrupted half-way through the layers (Ctrl-C): their offsets disagree now,
            # so no rollback can be exact; start over rather than decode from a torn cache.
            self.reset()
            raise

    def settle(self, kept: list[int], queued: int = 0, rows: Optional[list[int]] = None) -> None:
        """Keep the first len(kept) unsettled positions (their ids are `kept`) and forget the
        rest, except the last `queued` ones: a pass already queued for the next round, whose
        ids are not known on the host yet (they stay unsettled). After a tree, `rows` are
        the unsettled rows to keep (ascending: the root, then the accepted path), one per
        id of `kept`; their K/V move into place first."""
        extra = self.unsettled - len(kept) - queued
        if extra < 0 or (queued and extra) or (rows is not None and len(rows) != len(kept)):
            raise ValueError(f"cannot keep {len(kept)} + {queued} of {self.unsettled} fed positions")
        if rows is not None and rows != list(range(len(rows))):
            self._compact(rows)
        self._trim(extra)
        self.ids.extend(kept)
        self.unsettled = queued

    def rollback(self, n: int) -> None:
        """Forget the last n settled positions."""
        self._trim(n)
        del self.ids[len(self.ids) - n :]

    def _compact(self, rows: list[int]) -> None:
        """Move the K/V of unsettled `rows` to the first len(rows) unsettled slots of every
        layer (a row never moves later: rows ascend from where they start)."""
        for layer in self.cache:
            for buffers, end in _row_buffers(layer):
                first = end - self.unsettled
                index = mx.array(rows) + first
                for part in _parts(buffers):
                    part[..., first : first + len(rows), :] = part[..., index, :]

    def _trim(self, n: int) -> None:
        if n == 0:
            return
        self.prefill_hidden = None
        if n > self.max_rollback():
            raise ValueError(f"cannot roll back {n} positions of {type(self.model).__name__}")
        for layer in self.cache:
            layer.trim(n)

    def prefill(
        self,
        ids: list[int],
        chunk_size: int = 512,
        progress: Optional[Callable[[int, int], None]] = None,
        hidden: bool = False,
        keys: Optional[list] = None,
        inputs: Optional[Callable[[int, int], dict]] = None,
    ) -> int:
        """Make the cache hold exactly `ids`, reusing the longest common prefix it already
        holds (multi-turn chat prefills only the new turn). Returns tokens processed.

        hidden=True also keeps the final hidden state at the last position fed, from the
        last chunk's own pass (no extra forward), in `prefill_hidden` (None if nothing was
        fed): an MTP drafter starts its first draft from it.

        keys: what is compared for prefix reuse and held, a list that begins as long as
        `ids` (an image prompt's: image tokens marked by image); `ids` if None.
        inputs: inputs(begin, end) returns more inputs for the forward of rows begin..end of
        `ids`, by row over the whole of `keys` (an image prompt's input embeddings), or {}
        when those rows need none; called once, when there is anything to feed."""
        chunks = self.prefill_chunks(ids, chunk_size, progress, hidden, keys, inputs)
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                return done.value

    def prefill_chunks(self, ids: list[int], chunk_size: int = 512,
                       progress: Optional[Callable[[int, int], None]] = None, hidden: bool = False,
                       keys: Optional[list] = None, inputs: Optional[Callable[[int, int], dict]] = None):
        """`prefill` as a generator that yields after each chunk but the last (a batch decodes
        other requests in between) and returns the tokens processed."""
        self.prefill_hidden = None
        if self.unsettled:
            self.settle([])  # an interrupted round: drop its unsettled positions
        keys = ids if keys is None else keys[: len(ids)]
        common = common_prefix_length(self.ids, keys)
        surplus = len(self.ids) - common
        if surplus and self.quantized and common < self._switch():
            self.reset()  # a fresh cache would hold these positions in full precision
            common = 0
        elif surplus and surplus <= self.max_rollback():
            self.rollback(surplus)
        elif surplus:
            self.reset()
            common = 0
        todo = ids[common:]
        if progress is not None and todo:
            progress(0, len(todo))  # shown before the first chunk, which can take a while
        inputs = dict(inputs(common, len(ids))) if inputs is not None and todo else {}
        blocks = inputs.pop("image_blocks", None)
        if blocks is not None:  # an image's rows see each other: one pass, so no chunk splits an image
            chunk_size = max(len(todo), 1)
        for begin in range(0, len(todo), chunk_size):
            chunk = todo[begin : begin + chunk_size]
            last = hidden and begin + chunk_size >= len(todo)
            self._quantize_when_due()
            rows = slice(common + begin, common + begin + len(chunk))
            with _images_opened(self.cache, None if blocks is None else blocks[0, rows]):
                out = self._call(mx.array(chunk)[None], head=not last,
                                 **{name: value[:, rows] for name, value in inputs.items()})
            kept = out[:, -1:, :] if last else None  # [1, 1, H]
            with blas.threads_for(len(chunk)):  # evaluated here: every core's BLAS threads
                mx.eval([c.state for c in self.cache] + ([kept] if last else []))
            self.prefill_hidden = kept
            self.ids.extend(keys[rows])
            if progress is not None:
                progress(begin + len(chunk), len(todo))
            if begin + chunk_size < len(todo):
                yield begin + len(chunk)
        return len(todo)


def _row_buffers(layer) -> list:
    """A cache layer's (buffers holding one position per slot along axis 2, slots used)."""
    if isinstance(layer, ChannelQuantizedKVCache):
        return layer.row_buffers()
    end = layer.offset - getattr(layer, "start", 0)  # WindowKVCache's slot 0 moves
    return [(_parts(layer.keys) + _parts(layer.values), end)]


def _fork_layer(layer):
    # New handles for the layer's arrays: an in-place update (`keys[...] = x`) rebinds the
    # handle it is applied to, so the twin must not hold the same ones.
    twin = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, mx.array):
            setattr(twin, name, value[...])
        elif isinstance(value, (list, tuple)):  # a quantized (packed, scales, biases) triple
            setattr(twin, name, type(value)(v[...] if isinstance(v, mx.array) else v for v in value))
    return twin


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading ids two sequences share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """Both models' caches; pass the same object to successive calls (multi-turn chat) and
    only tokens not already held are prefilled."""

    def __init__(self, target_model, slack: int, kv: Optional[KVQuantization] = None,
                 draft_kv: Optional[KVQuantization] = None):
        self.slack = slack
        self.draft_kv = draft_kv
        self.target = SequenceCache(target_model, slack, kv=kv)
        self.draft: Optional[SequenceCache] = None

    def draft_for(self, draft_model, vocab: Optional[int] = None) -> SequenceCache:
        """The draft model's cache, created on first use (`vocab` as in `SequenceCache`)."""
        if self.draft is None or self.draft.model is not draft_model:
            self.draft = SequenceCache(draft_model, self.slack, vocab, kv=self.draft_kv)
        return self.draft

    def reset(self) -> None:
        self.target.reset()
        if self.draft is not None:
            self.draft.reset()

    def fork(self) -> "PromptCache":
        """A copy of both caches (see `SequenceCache.fork`)."""
        twin = copy.copy(self)
        twin.target = self.target.fork()
        twin.draft = self.draft.fork() if self.draft is not None else None
        return twin

    @property
    def nbytes(self) -> int:
        return self.target.nbytes + (self.draft.nbytes if self.draft is not None else 0)
