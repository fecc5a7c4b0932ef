"""Drafters: who proposes the γ tokens the target verifies.

One small protocol, after llama.cpp's common/speculative.h (begin / draft / accept):
  begin(prompt_ids, prompt_cache, processor)  prepare for a new request; returns tokens prefilled
  propose(gamma, history, key) -> Draft        up to γ tokens (lazy) and their q, or q = None
  accept(committed)                            the tokens the round committed; roll back the rest

A model-free drafter returns q = None and the verifier treats q as one-hot at its tokens.
A drafter that branches also has propose_tree(gamma, branches, history, key) -> Draft: a
draft tree (`mlx_spec.tree`) at most γ deep with at most `branches` leaves, q = None.
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

    @staticmethod
    def empty() -> "Draft":
        return Draft(mx.array([], dtype=mx.uint32))


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

__all__ = ["DRAFTER_NAMES", "Draft", "Drafter", "ModelDrafter", "NgramDrafter"]
