"""Several requests' passes as one forward per model (a continuous batch).

Each request keeps everything of its own: its `SequenceCache`s (so rollback, sliding
windows and the prompt-cache pool work as for one request), drafter, γ policy, sampling,
stats and stop handling. `Engine.rounds(batched=True)` yields each pass of a round instead
of running it: a draft model's steps as `DraftPass`es, the verify as a `TargetPass`
(`run_alone` runs them at once, as a request without a batch does). Only the forwards are
shared: `run_passes` feeds every row's block for one model, right-padded to the longest,
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_spec import blas
from mlx_spec.cache.forward import forward_model, ropes_replaced
from mlx_spec.cache.sequence import SequenceCache
from mlx_spec.cache.window_layers import WindowKVCache
from mlx_spec.tree import TreeShape


class _Prefilling:
    """Yielded by a request between its prompt's prefill chunks: no pass this step."""

    def __repr__(self) -> str:
        return "PREFILLING"


PREFILLING = _Prefilling()


class _RanAlone:
    """Yielded by a request after a round it ran without the batch (`Engine.rounds(alone=...)`):
    its passes this step have run."""

    def __repr__(self) -> str:
        return "RAN_ALONE"


RAN_ALONE = _RanAlone()


class Pass:
    """A forward that a request's round needs: run alone (`run`), or beside other requests'
    passes of the same `group` in one call (`run_together`)."""

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
    gave (lazy): logits [n, V] and, with `hidden`, final hidden states [n, H]."""

    cache: SequenceCache
    block: mx.array
    hidden: bool = False
    tree: Optional[TreeShape] = None
    logits: Optional[mx.array] = None
    hidden_states: Optional[mx.array] = None

    def group(self) -> tuple:
        return ModelPass, id(self.cache.model), self.hidden

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
    try:
        item = next(steps)
        while True:
            item.run()
            item = next(steps)
    except StopIteration as done:
        return done.value


def run_passes(passes: list[Pass]) -> None:
    """Run every pass: one call per group (the target's passes in one forward, a draft
    model's in another, the MTP assistant's in a third)."""
    groups: dict = {}
    for p in passes:
        groups.setdefault(p.group(), []).append(p)
    for group in groups.values():
        type(group[0]).run_together(group)


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


class Batch:
    """Generators that yield passes (`Engine.rounds(batched=True)`, or anything that passes
    them up), stepped together. Each `step` resumes every decoding one up to its next pass;
    while any of them has yielded a draft step's pass (a `DraftPass`, or the MTP
    assistant's), those run (one forward per draft model)
    and their generators resume, until each has yielded its `TargetPass` (a row with
    shorter chains, or none, waits for the others); then the target passes run in one
    forward, and each generator that is prefilling feeds its next prompt chunk (it yields
    `PREFILLING` after each). So N rows' draft step costs one forward, as their verify
    does, and a long prompt costs the others one chunk a round, after their tokens, never
    its whole prefill. Generators join (`add`) and leave (they end) between steps.
    A generator that finds itself `alone` may run its round itself and yield `RAN_ALONE`.
    Whatever else a generator yields goes to `out`."""

    def __init__(self, out=None):
        self.active: list = []
        self.out = out
        self.prefilling: set = set()  # generators whose last item was PREFILLING
        self.ready: dict = {}  # generator -> the pass it yielded after its prefill's last chunk
        self.resumed = None  # the generator being resumed

    def __len__(self) -> int:
        return len(self.active)

    def add(self, generator) -> None:
        self.active.append(generator)

    def alone(self) -> bool:
        """Whether the generator being resumed has no pass to share this step: every other
        one is prefilling (a chunk of its own; one just added may have a pass, so it counts)."""
        return all(g in self.prefilling for g in self.active if g is not self.resumed)

    def _advance(self, generator):
        """Resume `generator` to its next pass, PREFILLING or RAN_ALONE (None once it ends)."""
        self.resumed = generator
        try:
            item = next(generator)
            while not isinstance(item, Pass) and item is not PREFILLING and item is not RAN_ALONE:
                if self.out is not None:
                    self.out(generator, item)
                item = next(generator)
        except StopIteration:
            self.active.remove(generator)
            self.prefilling.discard(generator)
            return None
        return item

    def _run(self, pending: dict) -> None:
        """Run the passes of `pending` (generator -> its pass). If that fails, every
        request in it fails with the error (each generator may answer it, as a worker's
        job does) and leaves `pending`; the others go on."""
        try:
            run_passes(list(pending.values()))
        except Exception as error:
            for generator in list(pending):
                del pending[generator]
                self.active.remove(generator)
                try:
                    generator.throw(error)
                except StopIteration:
                    pass
                finally:
                    generator.close()

    def step(self) -> list:
        """One round of every active generator; returns those whose target pass it ran, or
        who ran their round alone (its rows)."""
        pending, prefilling, alone = {}, list(self.prefilling), []
        for generator in [g for g in self.active if g not in self.prefilling]:
            item = self.ready.pop(generator, None) or self._advance(generator)
            if item is PREFILLING:
                self.prefilling.add(generator)
            elif item is RAN_ALONE:
                alone.append(generator)
            elif item is not None:
                pending[generator] = item
        while drafting := {g: p for g, p in pending.items() if not isinstance(p, TargetPass)}:
            self._run(drafting)
            for generator in [g for g in pending if not isinstance(pending[g], TargetPass)]:
                if generator in drafting:
                    item = self._advance(generator)
                    if item is not None:
                        pending[generator] = item
                        continue
                del pending[generator]
        if pending:
            self._run(pending)
        for generator in prefilling:  # one chunk each, after the others' round
            item = self._advance(generator)
            if isinstance(item, Pass):
                self.prefilling.discard(generator)
                self.ready[generator] = item  # run with the others' next step
            elif item is RAN_ALONE:  # its prefill's end, then a first round of its own
                self.prefilling.discard(generator)
                alone.append(generator)
        return list(pending) + alone
