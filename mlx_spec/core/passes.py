"""A round's forwards as passes: run alone, or beside other requests' in one forward.

A round yields each forward it needs as a `Pass` instead of running it: a draft model's
steps as `DraftPass`es, the verify as a `TargetPass` (`run_alone` runs them at once, as a
request without a batch does; `mlx_spec.core.batch` collects several requests'). Only the
forwards are shared: `run_passes` feeds every row's block for one model, right-padded to the longest,
in one call, where each layer

- writes row i's K/V into row i's own cache (the padding is forgotten right after the
  forward, so a row's cache holds what its pass alone would have written),
- attends over every row's keys left-padded to the longest row's, under a per-row mask
  that is the row's own cache's mask (causal, sliding window) with the padding hidden,
- puts row i's RoPE at row i's own position.

A row's padding comes after its real tokens, so causality already hides it from them; the
left padding of the keys is masked; rows never see each other. So each row's logits are
those its request would get alone (up to the BLAS's rounding across batch shapes, which
the greedy rule's near-tie check absorbs as it does for a verify block's width).

Cost: each layer copies every row's visible keys and values into the batch tensor once
per forward (a row's whole context on full-attention layers, its window on sliding ones).

Time: a forward shared by several requests is timed once, and each pass in it is given its
share, `Pass.seconds`, in proportion to its rows (rows cost about the same whichever
request they belong to). `RoundClock` puts a batched round's shares into its draft and
verify times, in place of the time it waited for the batch (`Stats.draft_time` /
`verify_time`).
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.core.cache.forward import Hidden, forward_model, ropes_replaced
from mlx_spec.core.cache.sequence import SequenceCache
from mlx_spec.core.cache.window_layers import WindowKVCache
from mlx_spec.core.steps import drive
from mlx_spec.core.tree import TreeShape
from mlx_spec.platform import blas


class Pass:
    """A forward that a request's round needs: run alone (`run`), or beside other requests'
    passes of the same `group` in one call (`run_together`)."""

    seconds: float = 0.0  # this pass's share of the shared forward that ran it (`run_passes`)
    rows: int = 1  # positions it feeds, which its share is in proportion to

    def group(self) -> tuple:
        """Passes that can share one forward have equal groups."""
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError

    @classmethod
    def run_together(cls, passes: list) -> None:
        for p in passes:
            p.run()


@dataclass
class ModelPass(Pass):
    """One forward of a request's model over `block` ([n] ids) into its `cache`, and what it
    gave (lazy): logits [n, V] and, with `hidden`, final hidden states [n, H] (or, for
    hidden=(layer ids), those layers' outputs [n, k·H]: `cache.forward.Hidden`)."""

    cache: SequenceCache
    block: mx.array
    hidden: Hidden = False
    tree: Optional[TreeShape] = None
    logits: Optional[mx.array] = None
    hidden_states: Optional[mx.array] = None

    def group(self) -> tuple:
        return ModelPass, id(self.cache.model), self.hidden

    @property
    def rows(self) -> int:
        return self.block.shape[0]

    def run(self) -> None:
        """The pass alone, as a request without a batch runs it."""
        out = self.cache.forward(self.block, hidden=self.hidden, tree=self.tree)
        self.logits, self.hidden_states = out if self.hidden else (out, None)

    @classmethod
    def run_together(cls, passes: list["ModelPass"]) -> None:
        """One model's passes in one forward (see the module), or one after another where
        its layers cannot take per-row positions and masks."""
        if len(passes) == 1 or not all(p.cache.batchable for p in passes):
            return super().run_together(passes)
        if any(p.tree is not None for p in passes):
            raise ValueError("draft trees are not batched")
        rows = [p.cache for p in passes]
        lengths = [p.block.shape[0] for p in passes]
        width = max(lengths)
        tokens = mx.stack([mx.pad(row.fed_ids(p.block.astype(mx.uint32)), (0, width - n))
                           for p, row, n in zip(passes, rows, lengths)])
        layers = [_BatchLayer([row.cache[i] for row in rows]) for i in range(len(rows[0].cache))]
        offsets = mx.array([row.cache[0].offset for row in rows], mx.int32)  # every layer agrees
        hidden = passes[0].hidden
        try:
            with ropes_replaced(rows[0].model, lambda rope: _OffsetRoPE(rope, offsets)):
                out = forward_model(rows[0].model, tokens, layers, hidden=hidden)
            with blas.threads_for(tokens.size):  # evaluated here: a wide forward gets every core
                mx.eval(out)
        except BaseException:
            for row in rows:  # half-fed layers disagree now (see `SequenceCache._call`)
                row.reset()
            raise
        logits, states = out if hidden else (out, None)
        for i, (p, row, n) in enumerate(zip(passes, rows, lengths)):
            row.unsettled += n
            row.prefill_hidden = None
            row.forget_padding(width - n)  # at once: a draft model's next step writes where n ended
            p.logits = logits[i, :n]
            p.hidden_states = None if states is None else states[i, :n]


class TargetPass(ModelPass):
    """A request's verify pass (the target's): the last pass of its round."""


class DraftPass(ModelPass):
    """One step of a request's draft model; more passes of its round follow."""


def run_alone(steps):
    """Drive `steps`, a generator that yields passes and returns a value, without a batch:
    each pass runs as soon as it is yielded. Returns the generator's value."""
    return drive(steps, lambda step: step.run())


def run_passes(passes: list[Pass]) -> None:
    """Run every pass: one call per group (the target's passes in one forward, a draft
    model's in another, the MTP assistant's in a third)."""
    groups: dict = {}
    for p in passes:
        groups.setdefault(p.group(), []).append(p)
    for group in groups.values():
        start = perf_counter()
        type(group[0]).run_together(group)
        share_time(group, perf_counter() - start)


def share_time(group: list[Pass], seconds: float) -> None:
    """Each pass of a forward that took `seconds` is given its share, by its rows. A pass
    run alone is left lazy (`ModelPass.run`): ~0 here, its request evaluates it in its own
    time."""
    rows = sum(p.rows for p in group)
    for p in group:
        p.seconds = seconds * p.rows / rows if rows else seconds / len(group)


class RoundClock:
    """A batched round's time, as `Engine.run` reports it. While its generator is suspended
    on a pass, the batch runs the other requests' work and the shared forwards: that wall
    time (`waited`) is not this request's; its passes' shares (`Pass.seconds`) are, the
    target's (`TargetPass`) as verify time, the draft model's as draft time."""

    def __init__(self):
        self.waited = self.draft_share = self.verify_share = 0.0

    def through(self, steps):
        """`steps` (a generator of passes that returns a value) with its items yielded up
        and the suspensions timed; returns its value. Errors the batch throws in go on to
        `steps`."""
        try:
            item = next(steps)
            while True:
                suspended = perf_counter()
                try:
                    yield item
                except GeneratorExit:
                    steps.close()
                    raise
                except BaseException as error:
                    self.waited += perf_counter() - suspended
                    item = steps.throw(error)
                    continue
                self.waited += perf_counter() - suspended
                if isinstance(item, TargetPass):
                    self.verify_share += item.seconds
                elif isinstance(item, Pass):
                    self.draft_share += item.seconds
                item = next(steps)
        except StopIteration as stop:
            return stop.value


def pad_left(x: mx.array, width: int, axis: int) -> mx.array:
    """`x` zero-padded before its entries along `axis` to `width` (a batch's ragged rows)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (width - x.shape[axis], 0)
    return mx.pad(x, pad) if pad[axis][0] else x


class _BatchLayer:
    """One layer of every row's cache, seen by the model as one batched cache."""

    offset = 0  # unused: `_OffsetRoPE` gives each row its own RoPE position

    def __init__(self, layers: list):
        self.layers = layers

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        fetched = [layer.update_and_fetch(keys[i : i + 1], values[i : i + 1])
                   for i, layer in enumerate(self.layers)]
        width = max(k.shape[2] for k, _ in fetched)
        return tuple(mx.concatenate([pad_left(kv[j], width, 2) for kv in fetched]) for j in (0, 1))

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        masks = []
        for layer in self.layers:
            mask = layer.make_mask(N, window_size=window_size, return_array=True)
            masks.append(mx.ones((N, _keys_seen(layer, N)), mx.bool_) if mask is None else mask)
        width = max(m.shape[-1] for m in masks)
        return mx.stack([pad_left(m, width, 1) for m in masks])[:, None]  # [B, 1, N, keys]


def _keys_seen(layer, N: int) -> int:
    """Keys a row's layer returns for N new queries (its mask's width)."""
    return layer.keys_seen(N) if isinstance(layer, WindowKVCache) else layer.offset + N


class _OffsetRoPE(nn.Module):
    """An attention layer's own RoPE with batch row i at offsets[i] (MLX's rope takes one
    offset per batch row)."""

    def __init__(self, rope, offsets: mx.array):
        super().__init__()
        self.inner, self.offsets = rope, offsets

    def __call__(self, x: mx.array, offset=None) -> mx.array:
        return self.inner(x, offset=self.offsets)
