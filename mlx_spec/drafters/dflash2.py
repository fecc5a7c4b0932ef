"""DFlash 2 as the drafter: DFlash's rounds (`drafters.dflash`: one block forward from the
target's tap layers, batched as one forward) with the candidate selector
(`mlx_spec.models.dflash2`).

Position j draws among its top-k candidates, each scored by its logit plus the lattice
term after the token drawn at j − 1 (the anchor for j = 0), so tokens are drawn one after
another. A token's q is the processed distribution of the row it was drawn from: those
scores at the candidates' ids, −∞ (probability 0) everywhere else, so the Leviathan rule
stays exact though the draft can only propose candidates. At T = 0 the token is the best
candidate's id (mlx-vlm's `CandidateSelector.select`), q one-hot.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_spec.core.drafter import Draft
from mlx_spec.core.grammar import constrain
from mlx_spec.core.sampling import draw
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.models.dflash2 import is_dflash2_config, target_mismatch


class DFlash2Drafter(DFlashDrafter):
    """Drafts with a DFlash 2 draft (`models.dflash2.Model`) bound to `target`."""

    name = "dflash2"
    summary = "a DFlash 2 draft: a block per forward, candidates rescored after the token before"
    family = "DFlash 2"
    checkpoint = "a DFlash 2 draft checkpoint (DFlash2DraftModel)"
    detects = staticmethod(is_dflash2_config)
    target_mismatch = staticmethod(target_mismatch)

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed(self.head, ids)

    def block_rows(self, hidden: mx.array) -> list:
        """Each pass's (base logits [P, V], selector-projected rows [P, rank])."""
        hidden = hidden[:, 1:]
        logits = self.model.logits(self.head, hidden)
        projected = self.model.candidate_selector.hidden_projection(hidden)
        return [(logits[i], projected[i]) for i in range(hidden.shape[0])]

    def draw(self, rows, gamma: int, anchor: int, key: Optional[mx.array]) -> Draft:
        """Tokens one after another among each position's candidates [γ, top_k], scored
        after the token drawn before; under a grammar each row masked by what it allows
        (one host sync per position)."""
        logits, projected = rows[0][:gamma], rows[1][:gamma]
        greedy = self.processor.params.greedy
        grammar = self.processor.constraint
        selector = self.model.candidate_selector
        candidates = selector.candidates(logits)  # [γ, top_k]
        keys = None if greedy else mx.random.split(key, logits.shape[0])
        previous = mx.array([anchor])
        tokens, qs, path = [], [], []
        for j in range(logits.shape[0]):
            ids = candidates[j : j + 1]
            scores = selector.scores(logits[j : j + 1], projected[j : j + 1], ids, previous)  # [1, top_k]
            if greedy and grammar is None:
                previous = mx.take_along_axis(ids, mx.argmax(scores, axis=-1)[:, None], axis=-1)[:, 0]
            else:
                row = mx.full(logits[j : j + 1].shape, -mx.inf, scores.dtype)
                row[:, ids[0]] = scores
                if grammar is not None:
                    row = constrain(row, grammar.mask_after(path)[None])
                    if not mx.any(row > -mx.inf).item():  # no candidate is allowed
                        break
                if greedy:
                    previous = mx.argmax(row, axis=-1)
                else:
                    q_j = self.processor.distribution(row)
                    previous = draw(q_j, keys[j])
                    qs.append(q_j)
            if grammar is not None:
                token = previous.item()
                if token in grammar.eos_ids:  # the target decides where the value ends
                    qs = qs[: len(tokens)]
                    break
                path.append(token)
            tokens.append(previous)
            if grammar is not None and not grammar.continues(path):
                break
        if not tokens:
            return Draft.empty()
        return Draft(mx.concatenate(tokens).astype(mx.uint32), mx.concatenate(qs) if qs else None, forwards=1)
