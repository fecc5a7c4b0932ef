"""Drafters: who proposes the γ tokens the target verifies.

One small protocol, after llama.cpp's common/speculative.h (begin / draft / accept):
  begin(prompt_ids, prompt_cache, processor)  prepare for a new request; returns tokens prefilled
  propose(gamma, history, key) -> Draft        up to γ tokens (lazy) and their q, or q = None
  accept(committed)                            the tokens the round committed; roll back the rest

A drafter with a model of its own may also have drafting(gamma, history, key): `propose` as
a generator that yields each forward as a `batch.Pass` (see `draft_steps`).
A model-free drafter returns q = None and the verifier treats q as one-hot at its tokens.
A drafter that branches also has propose_tree(gamma, branches, history, key) -> Draft: a
draft tree (`mlx_spec.tree`) at most γ deep with at most `branches` leaves; its q is None
or, for a first child sampled from the draft, that q (later siblings one-hot).
A drafter with `wants_hidden = True` (MTP) gets the target's final hidden states: those of
the round's pass with accept(committed, target_hidden=...), and at begin the last prefilled
position's in prompt_cache.target.prefill_hidden (None if the prefill fed nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import mlx.core as mx

from mlx_spec.tree import TreeShape

# What `--drafter` accepts: a draft model, Gemma 4's MTP assistant (a draft model that reads
# the target's states), prompt lookup, or plain decoding.
DRAFTER_NAMES = ("model", "mtp", "ngram", "none")


@dataclass
class Draft:
    tokens: mx.array  # [γ'] uint32, γ' <= γ (a lookup drafter may find fewer)
    q: Optional[mx.array] = None  # [γ', V] processed draft distributions; None = one-hot
    tree: Optional[TreeShape] = None  # the tokens' tree; None = a chain
    forwards: Optional[int] = None  # draft model forwards it took; None: one per token and pass

    @staticmethod
    def empty() -> "Draft":
        return Draft(mx.array([], dtype=mx.uint32))


def likeliest(probs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k likeliest ids of probs [rows, V] and their probabilities, most likely first
    ([rows, k] each; a partition, then a sort of k, not of the vocabulary)."""
    ids = mx.argpartition(-probs, k - 1, axis=-1)[:, :k]
    top = mx.take_along_axis(probs, ids, axis=-1)
    order = mx.argsort(-top, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(top, order, axis=-1)


def sibling_leaves(chain: list[int], ranked: list[list[int]], probs: list[list[float]], chain_q: list[float],
                   branches: int, split_below: float, floor: float) -> list[tuple[int, int]]:
    """Where a drafted chain's draft was unsure, its next likeliest tokens as leaves.

    At depth j (0-based) where the top-1 probability probs[j][0] is below `split_below`,
    each ranked[j] token other than chain[j] with at least `floor` is a candidate, rated by
    the draft's own chance that it is reached and right: Π chain_q[:j] · its probability.
    Returns the best `branches` − 1 as (depth j, token), by depth, likeliest first (the
    tree: chain nodes 0..γ−1, then these, each under chain node j − 1)."""
    candidates, reach = [], 1.0
    for j, x in enumerate(chain):
        if probs[j][0] < split_below:
            candidates += [(reach * q, j, t) for t, q in zip(ranked[j], probs[j]) if t != x and q >= floor]
        reach *= chain_q[j]
    chosen = sorted(candidates, reverse=True)[: max(branches - 1, 0)]
    return [(j, t) for _, j, t in sorted(chosen, key=lambda c: (c[1], -c[0]))]


def with_leaves(chain: mx.array, leaves: list[tuple[int, int]], q: Optional[mx.array], forwards: int) -> Draft:
    """The chain plus `leaves` ((depth, token) from `sibling_leaves`) as one Draft; q's rows
    for the leaves are one-hot (V: q's width)."""
    gamma = chain.shape[0]
    if q is not None and leaves:
        one_hot = mx.arange(q.shape[-1])[None, :] == mx.array([t for _, t in leaves])[:, None]
        q = mx.concatenate([q, one_hot.astype(q.dtype)])
    if not leaves:
        return Draft(chain, q, forwards=forwards)
    parents = [*range(-1, gamma - 1), *(j - 1 for j, _ in leaves)]
    tokens = mx.concatenate([chain, mx.array([t for _, t in leaves], dtype=chain.dtype)])
    return Draft(tokens, q, tree=TreeShape(tuple(parents)), forwards=forwards)


def draft_steps(drafter, gamma: int, history: list[int], key: mx.array):
    """The drafter's proposal as a generator that yields its model passes and returns the
    Draft (`mlx_spec.batch`: a batch runs each pass beside other requests'). A drafter
    without `drafting` (model-free, or not batched) proposes at once."""
    if hasattr(drafter, "drafting"):
        return (yield from drafter.drafting(gamma, history, key))
    return drafter.propose(gamma, history, key)


class Drafter(Protocol):
    name: str
    passes_per_token: int  # draft model forwards per proposed token (0: model-free)

    @property
    def rollbackable(self) -> bool: ...

    def begin(self, prompt_ids: list[int], prompt_cache, processor) -> int: ...

    def propose(self, gamma: int, history: list[int], key: mx.array) -> Draft: ...

    def accept(self, committed: list[int]) -> None: ...


from mlx_spec.drafters.model import ModelDrafter  # noqa: E402
from mlx_spec.drafters.ngram import NgramDrafter  # noqa: E402

__all__ = ["DRAFTER_NAMES", "Draft", "Drafter", "draft_steps", "ModelDrafter", "NgramDrafter"]
