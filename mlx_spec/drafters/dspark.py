"""DSpark as the drafter: DFlash's rounds (`drafters.dflash`: one block forward from the
target's tap layers, batched as one forward), with the draft's Markov head, its reduced
vocabulary and its confidence head (`mlx_spec.models.dspark`).

The Markov head makes position j's distribution depend on the token drawn at j − 1 (the
anchor, the last committed token, for j = 0), so tokens are drawn one after another from
the block's logits, each row corrected by the token actually drawn before it, and that
corrected, processed row is the token's q: the Leviathan rule stays exact. With a reduced
vocabulary (`d2t`) a drawn draft id becomes its target id and q is the draft's row placed
at those ids, zero elsewhere (as EAGLE-3's). At T = 0 each token is the argmax of its
corrected row (q one-hot).

The confidence head, where the draft has one, cuts the block at the first position whose
estimated chance of acceptance is below the threshold (DeepSpec's prefix policy): position
j's estimate reads only the draft's state and the token drawn at j − 1, so the cut is a
stopping rule on kept tokens and the output distribution stays the target's. The threshold:
the drafter's `confidence_threshold`, else `MLX_SPEC_DSPARK_CONFIDENCE`, else the config's
`confidence_threshold`, else 0.5; 0 turns the cut off.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

from mlx_spec.core.cache.forward import text_model
from mlx_spec.core.grammar import constrain
from mlx_spec.core.sampling import draw
from mlx_spec.core.drafter import Draft
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.errors import UsageError
from mlx_spec.models.dspark import is_dspark_config, target_mismatch

DEFAULT_CONFIDENCE = 0.5


def resolve_threshold(args, given: Optional[float] = None) -> float:
    """The confidence cut's threshold for a draft with `args` (0: no cut)."""
    if not args.enable_confidence_head:
        return 0.0
    if given is None and os.environ.get("MLX_SPEC_DSPARK_CONFIDENCE"):
        try:
            given = float(os.environ["MLX_SPEC_DSPARK_CONFIDENCE"])
        except ValueError:
            raise UsageError("MLX_SPEC_DSPARK_CONFIDENCE must be a number in [0, 1]") from None
    if given is None:
        given = args.confidence_threshold if args.confidence_threshold is not None else DEFAULT_CONFIDENCE
    if not 0.0 <= given <= 1.0:
        raise UsageError(f"the DSpark confidence threshold must be in [0, 1], not {given}")
    return given


class DSparkDrafter(DFlashDrafter):
    """Drafts with a DSpark draft (`models.dspark.Model`) over `target`'s tap layers."""

    name = "dspark"
    summary = "a DSpark draft (DeepSpec): a block per forward, Markov-corrected, from the target's taps"
    family = "DSpark"
    checkpoint = "a DSpark draft checkpoint (DeepSpec's Gemma4DSparkModel, vLLM speculators or SpecForge)"
    detects = staticmethod(is_dspark_config)
    target_mismatch = staticmethod(target_mismatch)

    def __init__(self, draft, target, confidence_threshold: Optional[float] = None):
        super().__init__(draft, target)
        draft.bind(target)  # a Qwen 3 backbone borrows the target's embedding and head
        self.reduced = draft.args.draft_vocab_size is not None
        self.target_ids = draft.target_ids()  # [draft vocabulary]
        mx.eval(self.target_ids)  # now: a server decodes on another thread, where a lazy array made here fails
        self.width = text_model(target).model.embed_tokens.weight.shape[0]  # the target's logits
        self.threshold = resolve_threshold(draft.args, confidence_threshold)

    def block_tokens(self, token: int) -> list[int]:
        return self.model.block_tokens(token)

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed(ids)

    def block_rows(self, hidden: mx.array) -> list:
        """Each pass's (base logits [P, draft vocabulary], head rows [P, H])."""
        logits, rows = self.model.logits(hidden), self.model.head_hidden(hidden)
        return [(logits[i], rows[i]) for i in range(hidden.shape[0])]

    def draw(self, rows, gamma: int, anchor: int, key: Optional[mx.array]) -> Draft:
        """Tokens one after another from the block's base logits [γ, draft vocabulary], each
        row corrected by the Markov head for the token drawn before it; under a grammar each
        row masked by what it allows after them (one host sync per position); then the
        confidence cut."""
        base, rows = rows[0][:gamma], rows[1][:gamma]
        greedy = self.processor.params.greedy
        grammar = self.processor.constraint
        keys = None if greedy else mx.random.split(key, base.shape[0])
        previous = mx.array([anchor])
        tokens, qs, path = [], [], []
        for j in range(base.shape[0]):
            row = base[j : j + 1] + self.model.markov_head(previous)  # [1, draft vocabulary]
            if grammar is not None:
                allowed = grammar.mask_after(path)[None]
                if self.reduced:  # the mask over the target's logits (constrain's padding), read at the draft's ids
                    allowed = constrain(mx.zeros((1, self.width)), allowed) == 0
                    allowed = allowed[:, self.target_ids]
                    if not mx.any(allowed).item():  # nothing the grammar allows is in the draft vocabulary
                        break
                row = constrain(row, allowed)
            if greedy:
                chosen = mx.argmax(row, axis=-1)
            else:
                q_j = self.processor.distribution(row)
                chosen = draw(q_j, keys[j])
                if self.reduced:
                    q_j = mx.zeros((1, self.width), q_j.dtype).at[:, self.target_ids].add(q_j)
            previous = self.target_ids[chosen] if self.reduced else chosen
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
        kept = self._confidence_cut(rows[: len(tokens)], anchor, tokens)
        if kept == 0:
            return Draft.empty()
        return Draft(mx.concatenate(tokens[:kept]).astype(mx.uint32),
                     mx.concatenate(qs[:kept]) if qs else None, forwards=1)

    def _confidence_cut(self, rows: mx.array, anchor: int, tokens: list) -> int:
        """How many of the drawn `tokens` to keep: up to the first position whose estimated
        chance of acceptance is below the threshold (all of them with no cut). Position j's
        estimate reads its head row and the token before it, never the token drawn at j."""
        if self.threshold <= 0 or not tokens:
            return len(tokens)
        before = mx.concatenate([mx.array([anchor])] + [t.reshape(1) for t in tokens[:-1]])
        below = (self.model.confidence(rows, before) < self.threshold).tolist()
        return below.index(True) if True in below else len(tokens)
