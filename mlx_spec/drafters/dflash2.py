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

from mlx_spec.core.drafter import Draft, require_tapping_draft
from mlx_spec.core.grammar import constrain
from mlx_spec.core.sampling import draw
from mlx_spec.drafters.block import BlockPass
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.dflash import TargetHead
from mlx_spec.models.dflash2 import is_dflash2_config, target_mismatch


class DFlash2Drafter(DFlashDrafter):
    """Drafts with a DFlash 2 draft (`models.dflash2.Model`) bound to `target`."""

    name = "dflash2"
    summary = "a DFlash 2 draft: a block per forward, candidates rescored after the token before"

    def __init__(self, draft, target):
        mismatch = target_mismatch(draft.args, target)
        if mismatch:
            raise MlxSpecError(mismatch)
        self.model = draft
        self.target = target
        self.tap_layers = tuple(draft.args.target_layer_ids)
        self.head = TargetHead(target, draft.args.final_logit_softcapping)
        self.windows = [layer.self_attn.window for layer in draft.layers]
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> "DFlash2Drafter":
        require_tapping_draft("DFlash 2", cls.name, pair, world,
                              pair.draft is not None and is_dflash2_config(pair.draft.config),
                              "a DFlash 2 draft checkpoint (DFlash2DraftModel)")
        return cls(pair.draft.model, pair.target.model)

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed(self.head, ids)

    def block_rows(self, hidden: mx.array) -> list:
        """Each pass's (base logits [P, V], selector-projected rows [P, rank])."""
        hidden = hidden[:, 1:]
        logits = self.model.logits(self.head, hidden)
        projected = self.model.candidate_selector.hidden_projection(hidden)
        return [(logits[i], projected[i]) for i in range(hidden.shape[0])]

    def drafting(self, gamma: int, history: list[int], key: Optional[mx.array] = None):
        gamma = min(gamma, self.model.block_size - 1)
        if gamma <= 0 or self.context is None or self.context.held == 0:
            return Draft.empty()
        step = BlockPass(self, history[-1])
        yield step
        logits, projected = step.logits
        return self._draw(logits[:gamma], projected[:gamma], history[-1], key)

    def _draw(self, logits: mx.array, projected: mx.array, anchor: int, key: Optional[mx.array]) -> Draft:
        """Tokens one after another among each position's candidates [γ, top_k], scored
        after the token drawn before; under a grammar each row masked by what it allows
        (one host sync per position)."""
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
