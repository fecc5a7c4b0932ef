"""Draft trees from a chain: where the draft was unsure, its next likeliest tokens as
sibling leaves (no extra draft forward). Shared by the drafters that branch this way."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_spec.core.sampling import one_hot
from mlx_spec.core.tree import TreeShape
from mlx_spec.drafters.base import Draft


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
        q = mx.concatenate([q, one_hot(mx.array([t for _, t in leaves]), q.shape[-1], q.dtype)])
    if not leaves:
        return Draft(chain, q, forwards=forwards)
    parents = [*range(-1, gamma - 1), *(j - 1 for j, _ in leaves)]
    tokens = mx.concatenate([chain, mx.array([t for _, t in leaves], dtype=chain.dtype)])
    return Draft(tokens, q, tree=TreeShape(tuple(parents)), forwards=forwards)
