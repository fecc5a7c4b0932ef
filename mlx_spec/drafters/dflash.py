"""DFlash as the drafter: one draft forward proposes a whole block from the target's tap
layers (`mlx_spec.models.dflash` has the model and its math).

State: the draft's context keys and values (`dflash.Context`), one position per token the
target's cache holds. The engine hands over the target's tap-layer outputs out of the
passes it runs anyway (`Drafter.tap_layers`): at `begin` every position the prefill fed,
at `accept` the rows of the round's verify block that the target's cache kept (the last
committed token is fed by the next round's pass, so its state comes a round later). Only
committed positions are ever projected, so nothing needs rolling back within a request.

Each round drafts the block [last committed token, mask × (block_size − 1)] in one
forward and keeps its first γ positions (the block is always drafted at the width the
draft was trained at; γ only cuts it). Tokens and q: `block.draw_block`.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_spec.core.drafter import Draft, Drafter, require_tapping_draft
from mlx_spec.drafters.block import BlockPass, draw_block
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.dflash import Context, Model, TargetHead, is_dflash_config, sequence_mask, target_mismatch
from mlx_spec.core.passes import pad_left


class DFlashDrafter(Drafter):
    """Drafts with a DFlash block-diffusion draft (`models.dflash.Model`) bound to `target`."""

    name = "dflash"
    summary = "a DFlash draft (z-lab): one forward drafts a block from the target's tap layers"
    needs_draft_model = True
    passes_per_block = 1  # one draft forward per round, whatever γ
    wants_hidden = True
    # what a subclass family changes: its name in messages, the checkpoint it needs, and
    # its config's detection and fit checks
    family = "DFlash"
    checkpoint = "a DFlash draft checkpoint (a config.json with dflash_config)"
    detects = staticmethod(is_dflash_config)
    target_mismatch = staticmethod(target_mismatch)

    def __init__(self, draft: Model, target):
        mismatch = self.target_mismatch(draft.args, target)
        if mismatch:
            raise MlxSpecError(mismatch)
        self.model = draft
        self.target = target
        self.tap_layers = tuple(draft.args.target_layer_ids)
        self.head = TargetHead(target, draft.args.final_logit_softcapping)
        self.windows = [layer.self_attn.window for layer in draft.layers]
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> "DFlashDrafter":
        require_tapping_draft(cls.family, cls.name, pair, world,
                              pair.draft is not None and cls.detects(pair.draft.config), cls.checkpoint)
        return cls(pair.draft.model, pair.target.model)

    def reset(self) -> None:
        self.state = None  # the target's SequenceCache
        self.context: Optional[Context] = None
        self.processor = None

    def begin(self, prompt_ids: list[int], prompt_cache, processor) -> int:
        """Project what the prefill fed. A prompt cache reused across requests fed only the
        new tail: the context this drafter already holds for that cache is kept up to the
        reused prefix, else the context starts at the tail (the prefix's states are gone;
        drafts are then poorer, never wrong)."""
        state = prompt_cache.target
        fed = state.prefill_hidden
        n = 0 if fed is None else fed.shape[1]
        common = len(prompt_ids) - 1 - n  # positions the prefill reused
        context = self.context
        if state is not self.state or context is None or not context.base <= common <= context.length:
            context = Context(len(self.model.layers), base=common)
        else:
            context.trim(context.length - common)
        if n:
            self.model.extend(context, fed)
        self.state, self.context, self.processor = state, context, processor
        return 0

    def drafting(self, gamma: int, history: list[int], key: Optional[mx.array] = None):
        """`propose` as a generator that yields the round's one `BlockPass` (a batch runs it
        beside other requests') and returns the Draft."""
        gamma = min(gamma, self.model.block_size - 1)
        if gamma <= 0 or self.context is None or self.context.held == 0:
            return Draft.empty()
        step = BlockPass(self, history[-1])
        yield step
        return self.draw(step.logits, gamma, history[-1], key)

    def draw(self, rows, gamma: int, anchor: int, key: Optional[mx.array]) -> Draft:
        """The round's Draft from its pass's rows (`block_rows`), over the block's first γ
        positions after `anchor`, the last committed token."""
        return draw_block(rows[:gamma], self.processor, key)

    def block_logits(self, passes: list[BlockPass]) -> list[mx.array]:
        """Logits [block_size − 1, V] of each pass's block, in one forward: each row over its
        own context (left-padded to the longest row's, the padding masked) at its own
        positions."""
        tokens = mx.array([self.block_tokens(p.token) for p in passes])
        size = tokens.shape[1]
        drafters = [p.drafter for p in passes]
        if len(passes) == 1:
            contexts = [self.context.layer(i, w) for i, w in enumerate(self.windows)]
            offsets, masks = self.context.length, None
        else:
            contexts, masks = [], []
            for i, window in enumerate(self.windows):
                rows = [d.context.layer(i, window) for d in drafters]
                lengths = [k.shape[2] for k, _ in rows]
                width = max(lengths)
                contexts.append(tuple(mx.concatenate([pad_left(kv[j], width, 2) for kv in rows]) for j in (0, 1)))
                masks.append(sequence_mask(lengths, width, size))
            offsets = mx.array([d.context.length for d in drafters], mx.int32)
        return self.block_rows(self.model.hidden(self.embed(tokens), contexts, offsets, masks))

    def block_rows(self, hidden: mx.array) -> list:
        """What each pass gets from its block's final hidden states [B, block_size, H]: its
        draft positions' logits."""
        logits = self.draft_logits(hidden)
        return [logits[i] for i in range(hidden.shape[0])]

    def block_tokens(self, token: int) -> list[int]:
        """The block a round feeds: the last committed token, then mask tokens."""
        return [token] + [self.model.args.mask_token_id] * (self.model.block_size - 1)

    def embed(self, ids: mx.array) -> mx.array:
        return self.head.embed(ids)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """The draft positions' logits [B, block_size − 1, V] of a block's hidden states."""
        return self.head.logits(hidden[:, 1:])

    def accept(self, committed: list[int], target_hidden: Optional[mx.array] = None) -> None:
        """`target_hidden`: the tap layers' outputs of the round's pass [γ+1, k·H], row i at
        block token i; the target's cache kept rows 0..len(committed) − 1."""
        if self.context is None:
            return
        if target_hidden is None:  # no states for what was committed: the context is torn
            self.context = None
            return
        self.model.extend(self.context, target_hidden[None, : len(committed)])
