"""What our cache layers share: mixins for a draft tree's mask, exact trimming and mlx-lm's
serialisation protocol, and slot-by-slot access to a K/V buffer, which is an array or a
quantized (packed, scales, biases) triple with positions along axis 2."""

from __future__ import annotations

from typing import Optional

from mlx.utils import tree_map
from mlx_lm.models.cache import create_attention_mask

from mlx_spec.core.tree import TreeShape, tree_mask


class TreeMask:
    """A plain cache's mask, or a draft tree's while `tree` is set."""

    tree: Optional[TreeShape] = None

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if self.tree is not None:
            return tree_mask(self.tree, self.offset, window_size)
        return create_attention_mask(N, self.offset, return_array, window_size)


class ExactTrim:
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


class Restorable:
    """mlx-lm's cache serialisation protocol: arrays in `state`, scalars (as strings) in
    `meta_state`, and `from_state(state, meta_state)` builds the cache again."""

    @classmethod
    def from_state(cls, state, meta_state):
        obj = cls.__new__(cls)
        obj.meta_state, obj.state = meta_state, state
        return obj


def kv_slots(x, first: int, end: int):
    """Slots [first, end) of a K or V buffer (an array, or a quantized triple)."""
    return tree_map(lambda a: a[..., first:end, :], x)


def put_slots(x, first: int, new) -> None:
    """Write `new` into the slots from `first` on, in place (component by component)."""
    for a, b in zip(buffer_parts(x), buffer_parts(new)):
        a[..., first : first + b.shape[2], :] = b


def buffer_parts(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def slot_capacity(x) -> int:
    return buffer_parts(x)[0].shape[2]


def buffer_nbytes(x) -> int:
    return sum(a.nbytes for a in buffer_parts(x))


class PackedKV(tuple):
    """A quantized (packed, scales, biases) K or V as our caches return it to attention,
    which then runs `quantized_attention`."""

