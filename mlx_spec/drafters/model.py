"""A small language model as the drafter (Leviathan's Mq)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlx_spec.cache.sequence import common_prefix_length
from mlx_spec.core.grammar import constrain
from mlx_spec.core.passes import DraftPass, run_alone
from mlx_spec.core.sampling import draw, likeliest
from mlx_spec.drafters.base import Draft, Drafter, require_draft_model
from mlx_spec.drafters.broadcast import BroadcastDrafter
from mlx_spec.drafters.siblings import sibling_leaves, with_leaves
from mlx_spec.errors import UsageError
from mlx_spec.models.gemma4_assistant import is_assistant_config


class ModelDrafter(Drafter):
    """Drafts γ tokens autoregressively with a small model that shares the target's tokenizer.

    The draft cache lags the committed sequence by the `pending` tokens: normally the last
    committed token; after a fully accepted round also x_γ, which was sampled but never fed
    (mlx-lm's speculative loop keeps the same off-by-one).

    `propose_tree` drafts the same chain and, where the draft is unsure (its likeliest token
    has less than `split_below` of q), adds its next likeliest tokens as sibling leaves: no
    extra draft forward. Siblings are the draft's own ranking, distinct from the chain token
    and from each other, chosen before the target is consulted; so they are one-hot drafts
    for the tree rule, while a sampled chain token keeps its q (the Leviathan step).
    """

    name = "model"
    summary = "the draft model"
    needs_draft_model = True
    passes_per_token = 1
    own_cache = True
    can_branch = True
    # Past this many pending tokens (after γ = 0 rounds) catch up with a chunked prefill.
    catch_up_after = 8
    # Branch where the draft's top-1 probability is below this; a sibling needs at least
    # `sibling_floor` of q (a token the draft all but rules out is rarely the target's).
    split_below = 0.8
    sibling_floor = 0.02

    def __init__(self, model, target_vocab: int):
        """Args: model: the draft model; target_vocab: width of the target's logits, so that
        q is aligned to p when padded vocabulary widths differ."""
        self.model = model
        self.target_vocab = target_vocab
        self.draft_vocab = int(model(mx.array([[0]])).shape[-1])
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> Drafter:
        """Across ranks with the draft model on rank 0 only, the other ranks draft what
        rank 0 broadcasts (`BroadcastDrafter`); they know the draft by its vocabulary."""
        remote = world.active and pair.draft is None and pair.vocab_size_draft is not None
        if not remote:
            require_draft_model(cls.name, pair)
        if pair.draft is not None and is_assistant_config(pair.draft.config):
            raise UsageError("the draft is a Gemma 4 MTP assistant, which drafts from the target's "
                             "own states: use --drafter mtp (or leave --drafter out)")
        drafter = cls(pair.draft.model, pair.vocab_size_target) if pair.draft is not None else None
        if world.active and (drafter is None or (world.is_root and pair.draft_on == "root")):
            return BroadcastDrafter(world, drafter)
        return drafter

    def reset(self) -> None:
        self.state = None
        self.pending: list[int] = []
        self.fed_drafts: Optional[int] = None  # draft tokens fed to the cache this round
        self.fed_chain: Optional[list[int]] = None  # after a tree round: the chain tokens fed

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
        self.fed_drafts = self.fed_chain = None
        return processed

    def drafting(self, gamma: int, history: list[int], key: mx.array):
        """`propose` as a generator that yields each draft step's `DraftPass` (a batch runs
        it beside other requests') and returns the Draft."""
        if gamma == 0:
            self.fed_drafts = self.fed_chain = None
            return Draft.empty()
        xs, qs, _ = yield from self._chain(gamma, history, key)
        if not xs:  # a grammar's value may end here: the target decides
            return Draft.empty()
        return Draft(mx.concatenate(xs), self._pad(mx.concatenate(qs)) if qs else None)

    def _chain(self, gamma: int, history: list[int], key: mx.array, ranked: int = 0):
        """Draft x_1..x_γ (lazy), a generator that yields each step's `DraftPass` and
        returns their tokens [1] each, q_j [1, V] each (sampling only), and with `ranked`
        > 0 the `ranked` likeliest tokens and their probabilities per step ([1, ranked]
        each, from q, or at temperature 0 from the penalised softmax).

        Under the processor's constraint each step's logits are masked as the target's row
        for the same path will be (so q is the constrained draft distribution), and the
        chain stops before an EOS or after a token that completes the value: one host
        sync per step, for the next step's mask."""
        self.fed_drafts = self.fed_chain = None
        if len(self.pending) > self.catch_up_after:
            self.state.prefill(self.state.ids + self.pending[:-1])
            self.pending = self.pending[-1:]
        greedy = self.processor.params.greedy
        keys = None if greedy else mx.random.split(key, gamma)
        xs: list[mx.array] = []
        qs: list[mx.array] = []
        tops: list[tuple[mx.array, mx.array]] = []
        y = mx.array(self.pending, dtype=mx.uint32)
        grammar = self.processor.constraint
        path: list[int] = []  # the chain so far on the host, for the grammar's masks
        self.fed_drafts = gamma - 1  # x_γ is sampled, not fed
        for j in range(gamma):
            step = DraftPass(self.state, y)
            yield step
            logits = step.logits  # [len(y), V_draft]
            if logits.shape[0] > 1:
                logits = logits[-1:]
            if logits.shape[-1] > self.target_vocab:  # ids the target cannot score
                logits = logits[:, : self.target_vocab]
            if grammar is not None:
                logits = constrain(logits, grammar.mask_after(path)[None])
            windows = None
            if self.processor.params.penalized:
                block = mx.concatenate(xs) if xs else None
                windows = self.processor.windows(history, block, j + 1, first=j)
            if greedy:
                y = self.processor.likeliest(logits, windows)
                if ranked:
                    probs = mx.softmax(self.processor.penalize(logits.astype(mx.float32), windows), axis=-1)
            else:
                probs = q_j = self.processor.distribution(logits, windows)
                y = draw(q_j, keys[j])
                qs.append(q_j)
            if ranked:
                tops.append(likeliest(probs, ranked))
            if grammar is not None:
                token = y.item()
                if token in grammar.eos_ids:
                    del qs[j:]
                    self.fed_drafts = j  # this step fed x_j; no x_{j+1} is kept
                    break
                path.append(token)
            mx.async_eval(y)
            xs.append(y)
            if grammar is not None and not grammar.continues(path):
                self.fed_drafts = j
                break
        return xs, qs, tops

    def _pad(self, q: mx.array) -> mx.array:
        if q.shape[-1] < self.target_vocab:  # ids the draft cannot produce get q = 0
            q = mx.pad(q, [(0, 0), (0, self.target_vocab - q.shape[-1])])
        return q

    def propose_tree(self, gamma: int, branches: int, history: list[int], key: mx.array) -> Draft:
        """The chain `propose` would draft (nodes 0..γ-1), then up to `branches` - 1 sibling
        leaves where the draft is split, the ones the draft itself rates likeliest to be
        reached and right first (Π q of the chain above × q of the sibling). One host sync,
        to shape the tree."""
        if gamma == 0:
            self.fed_drafts = self.fed_chain = None
            return Draft.empty()
        xs, qs, tops = run_alone(self._chain(gamma, history, key, ranked=branches))
        chain = mx.concatenate(xs)
        top_ids = mx.concatenate([ids for ids, _ in tops])  # [γ, branches]
        top_q = mx.concatenate([q for _, q in tops])
        q_chain = mx.concatenate([mx.take(q, x) for q, x in zip(qs, xs)]) if qs else top_q[:, 0]
        mx.eval(chain, top_ids, top_q, q_chain)
        x = chain.tolist()
        self.fed_chain = x[: gamma - 1]
        leaves = sibling_leaves(x, top_ids.tolist(), top_q.tolist(), q_chain.tolist(), branches,
                                self.split_below, self.sibling_floor)
        return with_leaves(chain, leaves, self._pad(mx.concatenate(qs)) if qs else None, forwards=gamma)

    def accept(self, committed: list[int], target_hidden=None) -> None:
        self.pending = self._rolled_back(committed)
        self.fed_drafts = self.fed_chain = None

    def _rolled_back(self, committed: list[int]) -> list[int]:
        """Roll the draft cache back to the committed tokens it was fed; returns the
        committed tokens it was not fed (the next round's `pending`).

        The off-by-one: a round feeds pending + x_1..x_{γ−1} (x_γ is sampled, never fed),
        and the round's last committed token (recovered or bonus) is never a fed draft, so
        at most len(committed) − 1 drafts stay, and that last token is always pending, as
        in mlx-lm's speculative loop. After a tree the committed path may leave the chain at
        a sibling: only the part the chain shares stays."""
        if self.fed_drafts is None:  # nothing fed this round: the draft just falls behind
            return self.pending + committed
        keep = min(len(committed) - 1, self.fed_drafts)
        if self.fed_chain is not None:
            keep = min(keep, common_prefix_length(self.fed_chain, committed))
        self.state.settle(self.pending + committed[:keep])
        return committed[keep:]
