"""DSpark (Gemma 4) as the drafter: DFlash's rounds (`drafters.dflash`: one block forward
from the target's tap layers, batched as one forward), with the draft's own embedding and
head and its Markov head (`mlx_spec.models.dspark`).

The Markov head makes position j's distribution depend on the token drawn at j − 1 (the
anchor, the last committed token, for j = 0), so tokens are drawn one after another from
the block's logits, each row corrected by the token actually drawn before it, and that
corrected, processed row is the token's q: the Leviathan rule stays exact. At T = 0 each
token is the argmax of its corrected row (q one-hot).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_spec.core.grammar import constrain
from mlx_spec.core.sampling import draw
from mlx_spec.core.drafter import Draft, require_tapping_draft
from mlx_spec.drafters.block import BlockPass
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.dspark import Model, is_dspark_config, target_mismatch


class DSparkDrafter(DFlashDrafter):
    """Drafts with a Gemma 4 DSpark draft (`models.dspark.Model`) over `target`'s tap layers."""

    name = "dspark"
    summary = "a Gemma 4 DSpark draft (DeepSpec): a block per forward, Markov-corrected, from the target's taps"

    def __init__(self, draft: Model, target):
        mismatch = target_mismatch(draft.args, target)
        if mismatch:
            raise MlxSpecError(mismatch)
        self.model = draft
        self.target = target
        self.tap_layers = tuple(draft.args.target_layer_ids)
        self.windows = [layer.self_attn.window for layer in draft.layers]
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> "DSparkDrafter":
        require_tapping_draft("DSpark", cls.name, pair, world,
                              pair.draft is not None and is_dspark_config(pair.draft.config), "a Gemma 4 DSpark draft checkpoint (Gemma4DSparkModel)")
        return cls(pair.draft.model, pair.target.model)

    def block_tokens(self, token: int) -> list[int]:
        return self.model.block_tokens(token)

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed(ids)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        return self.model.logits(hidden)

    def drafting(self, gamma: int, history: list[int], key: Optional[mx.array] = None):
        gamma = min(gamma, self.model.block_size - 1)
        if gamma <= 0 or self.context is None or self.context.held == 0:
            return Draft.empty()
        step = BlockPass(self, history[-1])
        yield step
        return self._draw(step.logits[:gamma], history[-1], key)

    def _draw(self, base: mx.array, anchor: int, key: Optional[mx.array]) -> Draft:
        """Tokens one after another from the block's base logits [γ, V], each row corrected
        by the Markov head for the token drawn before it; under a grammar each row masked by
        what it allows after them (one host sync per position)."""
        greedy = self.processor.params.greedy
        grammar = self.processor.constraint
        keys = None if greedy else mx.random.split(key, base.shape[0])
        previous = mx.array([anchor])
        tokens, qs, path = [], [], []
        for j in range(base.shape[0]):
            row = base[j : j + 1] + self.model.markov_head(previous)  # [1, V]
            if grammar is not None:
                row = constrain(row, grammar.mask_after(path)[None])
            if greedy:
                previous = mx.argmax(row, axis=-1)
            else:
                q_j = self.processor.distribution(row)
                previous = draw(q_j, keys[j])
            if grammar is not None:
                token = previous.item()
                if token in grammar.eos_ids:  # the target decides where the value ends
                    break
                path.append(token)
            tokens.append(previous)
            if not greedy:
                qs.append(q_j)
            if grammar is not None and not grammar.continues(path):
                break
        if not tokens:
            return Draft.empty()
        return Draft(mx.concatenate(tokens).astype(mx.uint32), mx.concatenate(qs) if qs else None, forwards=1)
