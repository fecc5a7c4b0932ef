"""Sliding-window layers that roll back exactly.

mlx-lm's `RotatingKVCache` (Gemma's sliding-window layers) cannot forget positions once it
has wrapped: the slots a rejected draft overwrote held the oldest positions of the window,
which the next query still needs. `WindowKVCache` keeps `slack` positions more than the
window needs and enforces the window through the attention mask, so a rollback of up to
`slack` positions is exact at any context length. `QuantizedWindowKVCache` is its
`--kv-bits` twin: positions are quantized one by one (a group lies along head_dim), so
trimming the packed arrays is as exact as trimming plain ones.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from mlx_spec.cache.layer_base import (
    ExactTrim,
    PackedKV,
    Restorable,
    buffer_nbytes,
    kv_slots,
    put_slots,
    slot_capacity,
)
from mlx_spec.core.tree import TreeShape, tree_mask


class WindowKVCache(ExactTrim, Restorable):
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
        capacity = 0 if self.keys is None else slot_capacity(self.keys)
        if self.offset - self.start + n_new <= capacity:
            return self.start
        return max(self.start, self.offset - self.retain)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n_new = keys.shape[2]
        used = self.offset - self.start
        if self.keys is None or used + n_new > slot_capacity(self.keys):
            new_start = self._start_after(n_new)
            kept = used - (new_start - self.start)
            B, heads, _, k_dim = keys.shape
            capacity = kept + n_new + self.step
            new_keys = self._empty((B, heads, capacity), k_dim, keys.dtype)
            new_values = self._empty((B, heads, capacity), values.shape[3], values.dtype)
            if kept > 0:
                put_slots(new_keys, 0, kv_slots(self.keys, used - kept, used))
                put_slots(new_values, 0, kv_slots(self.values, used - kept, used))
            self.keys, self.values, self.start, used = new_keys, new_values, new_start, kept
        put_slots(self.keys, used, self._pack(keys))
        put_slots(self.values, used, self._pack(values))
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

    # mlx-lm's serialisation protocol (`Restorable`): arrays in `state`, scalars in `meta_state`
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
        return 0 if self.keys is None else buffer_nbytes(self.keys) + buffer_nbytes(self.values)


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

