"""A small language model as the drafter (Leviathan's Mq)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_spec.drafters import Draft
from mlx_spec.sampling import draw


class ModelDrafter:
    """Drafts γ tokens autoregressively with a small model that shares the target's tokenizer.

    The draft cache lags the committed sequence by the `pending` tokens: normally the last
    committed token; after a fully accepted round also x_γ, which was sampled but never fed
    (mlx-lm's speculative loop keeps the same off-by-one).
    """

    name = "model"
    passes_per_token = 1
    # Past this many pending tokens (after γ = 0 rounds) catch up with a chunked prefill.
    catch_up_after = 8

    def __init__(self, model, target_vocab: int):
        """Args: model: the draft model; target_vocab: width of the target's logits, so that
        q is aligned to p when padded vocabulary widths differ."""
        self.model = model
        self.target_vocab = target_vocab
        self.draft_vocab = int(model(mx.array([[0]])).shape[-1])
        self.state = None
        self.pending: list[int] = []
        self.fed_drafts: Optional[int] = None  # draft tokens fed to the cache this round

    @property
    def rollbackable(self) -> bool:
        return self.state is None or self.state.rollbackable

    def begin(self, prompt_ids: list[int], prompt_cache, processor) -> int:
        # The target can commit ids a narrower draft lacks (Gemma 3 12B: 262208 wide, 270M:
        # 262144); the draft cache feeds those as a placeholder (exactness never needs q).
        narrower = self.draft_vocab if self.draft_vocab < self.target_vocab else None
        self.state = prompt_cache.draft_for(self.model, narrower)
        self.processor = processor
        processed = self.state.prefill(prompt_ids[:-1])
        self.pending = list(prompt_ids[len(self.state.ids) :])
        self.fed_drafts = None
        return processed

    def propose(self, gamma: int, history: list[int], key: mx.array) -> Draft:
        self.fed_drafts = None
        if gamma == 0:
            return Draft.empty()
        if len(self.pending) > self.catch_up_after:
            self.state.prefill(self.state.ids + self.pending[:-1])
            self.pending = self.pending[-1:]
        greedy = self.processor.params.greedy
        keys = None if greedy else mx.random.split(key, gamma)
        xs: list[mx.array] = []
        qs: list[mx.array] = []
        y = mx.array(self.pending, dtype=mx.uint32)
        for j in range(gamma):
            logits = self.state.forward(y)  # [len(y), V_draft]
            if logits.shape[0] > 1:
                logits = logits[-1:]
            if logits.shape[-1] > self.target_vocab:  # ids the target cannot score
                logits = logits[:, : self.target_vocab]
            windows = None
            if self.processor.params.penalized:
                block = mx.concatenate(xs) if xs else None
                windows = self.processor.windows(history, block, j + 1, first=j)
            if greedy:
                y = self.processor.greedy(logits, windows)
            else:
                q_j = self.processor.distribution(logits, windows)
                y = draw(q_j, keys[j])
                qs.append(q_j)
            mx.async_eval(y)
            xs.append(y)
        self.fed_drafts = gamma - 1  # x_γ is sampled, not fed
        q = None
        if qs:
            q = mx.concatenate(qs)
            if q.shape[-1] < self.target_vocab:  # ids the draft cannot produce get q = 0
                q = mx.pad(q, [(0, 0), (0, self.target_vocab - q.shape[-1])])
        return Draft(mx.concatenate(xs), q)

    def accept(self, committed: list[int]) -> None:
        if self.fed_drafts is None:  # nothing fed this round: the draft just falls behind
            self.pending += committed
            return
        # The cache holds pending + x_1..x_{γ-1}; keep the drafts that were committed, except
        # the last committed token, which becomes pending like any round's final token.
        keep = min(len(committed) - 1, self.fed_drafts)
        self.state.settle(self.pending + committed[:keep])
        self.pending = committed[keep:]
        self.fed_drafts = None
