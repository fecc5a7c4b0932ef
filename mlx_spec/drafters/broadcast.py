"""Rank 0's drafter across the ranks of a sharded target (`mlx_spec.apps.distributed`)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_spec.drafters.base import Draft, Drafter


class BroadcastDrafter(Drafter):
    """Rank 0's drafter, with its tokens broadcast to every rank before the verify pass.

    On rank 0 it wraps the real drafter; elsewhere `inner` is None and it proposes whatever
    rank 0 proposed (the count is the same on every rank: a draft model always returns γ
    tokens, and the γ policy agrees). Only rank 0 holds q, so the acceptance decision is
    rank 0's, broadcast (`World.agree_verdict`). Chains only: every rank must feed the same
    block, and a tree's shape is not broadcast.

    Args:
        world: the `distributed.World` (anything with `broadcast(array)`).
        inner: rank 0's drafter, or None on the other ranks.
    """

    passes_per_token = 1

    def __init__(self, world, inner: Optional[Drafter] = None, name: str = "model"):
        self.world = world
        self.inner = inner
        self.name = inner.name if inner is not None else name
        self.model = inner.model if inner is not None else None
        self.own_cache = inner is not None and inner.own_cache

    @property
    def rollbackable(self) -> bool:
        return True if self.inner is None else self.inner.rollbackable

    def fork(self) -> "BroadcastDrafter":
        return BroadcastDrafter(self.world, None if self.inner is None else self.inner.fork(), self.name)

    def begin(self, prompt_ids, prompt_cache, processor) -> int:
        return self.inner.begin(prompt_ids, prompt_cache, processor) if self.inner else 0

    def propose(self, gamma: int, history, key) -> Draft:
        if self.inner is not None:
            draft = self.inner.propose(gamma, history, key)
            return Draft(self.world.broadcast(draft.tokens), draft.q)
        return Draft(self.world.broadcast(mx.zeros((gamma,), mx.uint32)))

    def accept(self, committed, target_hidden=None) -> None:
        if self.inner is not None:
            self.inner.accept(committed, target_hidden)
