"""What block drafters share: drawing a block's tokens from the per-position logits of one
draft forward, and the pass that runs every request's block forward in one call.

A block drafter (DFlash, DSpark) proposes the whole block in one forward, so position j's
distribution does not depend on the tokens drawn before it (unless a Markov head adds
that); each token is drawn from its own position's processed distribution, and that row is
its q. At temperature 0 the draft is the argmax (q one-hot, `Draft.q = None`). Under a
grammar each row is masked by what the grammar allows after the tokens drawn before it, as
the target's rows are, so q and p see the same constraint; that needs the previous token
on the host, one sync per position (as the model drafter's chain does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlx_spec.core.drafter import Draft
from mlx_spec.core.grammar import constrain
from mlx_spec.core.passes import Pass
from mlx_spec.core.sampling import LogitProcessor, draw


def draw_block(logits: mx.array, processor: LogitProcessor, key: Optional[mx.array]) -> Draft:
    """The draft for a block's per-position logits [γ, V] (one forward: `forwards=1`)."""
    greedy = processor.params.greedy
    grammar = processor.constraint
    if grammar is None:
        if greedy:
            return Draft(mx.argmax(logits, axis=-1).astype(mx.uint32), None, forwards=1)
        q = processor.distribution(logits)
        return Draft(draw(q, key).astype(mx.uint32), q, forwards=1)
    keys = None if greedy else mx.random.split(key, logits.shape[0])
    path: list[int] = []
    qs: list[mx.array] = []
    for j in range(logits.shape[0]):
        row = constrain(logits[j : j + 1], grammar.mask_after(path)[None])
        if greedy:
            token = mx.argmax(row, axis=-1)
        else:
            q_j = processor.distribution(row)
            token = draw(q_j, keys[j])
        token = token.item()
        if token in grammar.eos_ids:  # the target decides where the value ends
            break
        path.append(token)
        if not greedy:
            qs.append(q_j)
        if not grammar.continues(path):
            break
    q = mx.concatenate(qs) if qs else None
    return Draft(mx.array(path, dtype=mx.uint32), q, forwards=1)


@dataclass
class BlockPass(Pass):
    """One request's block forward: the block led by `token` (the last committed token),
    giving `logits` [block_size − 1, V] for the draft positions. In a batch every
    request's block of the same draft runs as one forward (`drafter.block_logits`)."""

    drafter: object
    token: int
    logits: Optional[mx.array] = None

    def group(self) -> tuple:
        return BlockPass, id(self.drafter.model)

    def run(self) -> None:
        (self.logits,) = self.drafter.block_logits([self])

    @classmethod
    def run_together(cls, passes: list["BlockPass"]) -> None:
        for p, logits in zip(passes, passes[0].drafter.block_logits(passes)):
            p.logits = logits
