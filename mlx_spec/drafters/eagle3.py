"""EAGLE-3 (speculators format) as the drafter (`mlx_spec.models.eagle3` has the model).

State: the draft's own cache, entry p pairing the target's tap states at position p with
the token at p + 1, for every position the target's cache holds; and the seed, the draft's
h at the newest entry, whose logits give the next round's first draft token. The engine
hands over the taps out of the passes it runs anyway: at `begin` every position the
prefill fed, at `accept` the rows of the round's verify block the target's cache kept.
`accept` rolls back the entries the round's own draft steps added, then feeds the
committed tokens with those rows: one draft forward, whose last h is the new seed. A round
of γ drafts takes γ forwards in all (that one, then γ − 1 steps on the draft's own h); in
a batch, each of those steps runs as one draft forward for every request (`StepPass`).

A reduced vocabulary (`d2t`) is mapped into the target's: a draft token is the target id
of the draft id drawn, and q is the draft's processed distribution placed at those ids,
zero elsewhere. The target's p is over the whole vocabulary, so greedy output is plain
decoding's whatever the draft vocabulary lacks (mlx-vlm compares the draft with the
target's best token among the draft vocabulary, and so diverges where the true argmax is
outside it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlx_spec.core.cache.forward import text_model
from mlx_spec.core.drafter import Draft, Drafter, require_tapping_draft
from mlx_spec.errors import MlxSpecError
from mlx_spec.core.grammar import constrain
from mlx_spec.core.passes import Pass
from mlx_spec.models.eagle3 import Model, is_eagle3_config, target_mismatch
from mlx_spec.core.sampling import draw


@dataclass
class StepPass(Pass):
    """One draft step of one request: the draft's h after `token` [1, 1] and its own h
    [1, 1, H], written into the request's cache. In a batch every request's step of the
    same draft runs as one forward (`Model.step_rows`)."""

    drafter: "Eagle3Drafter"
    token: mx.array
    h: mx.array
    out: Optional[mx.array] = None

    def group(self) -> tuple:
        return StepPass, id(self.drafter.model)

    def run(self) -> None:
        d = self.drafter
        self.out = d.model.hidden(self.token, self.h, d.cache, d.length + 1, taps=False)

    @classmethod
    def run_together(cls, passes: list["StepPass"]) -> None:
        if len(passes) == 1:
            return passes[0].run()
        drafters = [p.drafter for p in passes]
        h = drafters[0].model.step_rows(mx.concatenate([p.token for p in passes]),
                                        mx.concatenate([p.h for p in passes]),
                                        [d.cache for d in drafters], [d.length + 1 for d in drafters])
        for i, p in enumerate(passes):
            p.out = h[i : i + 1]


class Eagle3Drafter(Drafter):
    """Drafts with an EAGLE-3 draft (`models.eagle3.Model`) over `target`'s tap layers."""

    name = "eagle3"
    summary = "an EAGLE-3 draft (speculators format) over three of the target's layers"
    needs_draft_model = True
    passes_per_token = 1
    wants_hidden = True

    def __init__(self, draft: Model, target):
        mismatch = target_mismatch(draft.args, target)
        if mismatch:
            raise MlxSpecError(mismatch)
        self.model = draft
        self.tap_layers = draft.args.tap_layers
        self.target_ids = draft.target_ids()  # [draft vocabulary]
        mx.eval(self.target_ids)  # now: a server decodes on another thread, where a lazy array made here fails
        self.width = text_model(target).model.embed_tokens.weight.shape[0]  # the target's logits
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> "Eagle3Drafter":
        require_tapping_draft("EAGLE-3", cls.name, pair, world,
                              pair.draft is not None and is_eagle3_config(pair.draft.config), "an EAGLE-3 draft checkpoint (speculators format)")
        return cls(pair.draft.model, pair.target.model)

    def reset(self) -> None:
        self.state = None  # the target's SequenceCache
        self.cache: Optional[list] = None
        self.base = 0  # the target position of the cache's first entry
        self.seed: Optional[mx.array] = None  # [1, 1, H] the draft's h at the newest entry
        self.stepped = 0  # entries this round's draft steps added
        self.processor = None

    @property
    def length(self) -> int:
        """Target positions whose states the cache holds (from 0, counting a missing prefix)."""
        return self.base + (self.cache[0].offset if self.cache else 0)

    def begin(self, prompt_ids: list[int], prompt_cache, processor) -> int:
        """Feed what the prefill fed (a reused prefix keeps the entries this drafter holds
        for it, as `DFlashDrafter.begin`); with nothing fed, round 1 is plain."""
        state = prompt_cache.target
        fed = state.prefill_hidden
        n = 0 if fed is None else fed.shape[1]
        common = len(prompt_ids) - 1 - n
        if state is not self.state or self.cache is None or not self.base <= common <= self.length:
            self.cache, self.base = self.model.make_cache(), common
        else:
            for c in self.cache:
                c.trim(self.length - common)
        self.state, self.processor, self.seed, self.stepped = state, processor, None, 0
        if n:
            self._feed(prompt_ids[common + 1 :], fed)
        return 0

    def _feed(self, tokens: list[int], taps: mx.array) -> None:
        """Entries for the target's states taps [1, n, k·H] and the n tokens after them."""
        h = self.model.hidden(mx.array([tokens]), taps, self.cache, self.length + 1, taps=True)
        self.seed = h[:, -1:]

    def drafting(self, gamma: int, history: list[int], key: Optional[mx.array] = None):
        """`propose` as a generator that yields each draft step after the first as a
        `StepPass` (the first reads the seed that `accept` left), and returns the Draft."""
        if gamma == 0 or self.seed is None:
            return Draft.empty()
        greedy = self.processor.params.greedy
        grammar = self.processor.constraint
        keys = None if greedy else mx.random.split(key, gamma)
        h, tokens, qs, path = self.seed, [], [], []
        for j in range(gamma):
            if j:
                step = StepPass(self, tokens[-1][None], h)
                yield step
                h = step.out
                self.stepped += 1
            logits = self.model.logits(h)[0].astype(mx.float32)  # [1, draft vocabulary]
            if grammar is not None:
                # the mask over the target's logits (constrain's padding), read at the draft's ids
                allowed = constrain(mx.zeros((1, self.width)), grammar.mask_after(path)[None]) == 0
                allowed = allowed[:, self.target_ids]
                if not mx.any(allowed).item():  # nothing the grammar allows is in the draft vocabulary
                    break
                logits = constrain(logits, allowed)
            if greedy:
                chosen = mx.argmax(logits, axis=-1)
            else:
                q_draft = self.processor.distribution(logits)
                chosen = draw(q_draft, keys[j])
                qs.append(mx.zeros((1, self.width), mx.float32).at[:, self.target_ids].add(q_draft))
            token = self.target_ids[chosen].astype(mx.uint32)  # [1]
            if grammar is not None:
                t = token.item()
                if t in grammar.eos_ids:  # the target decides where the value ends
                    del qs[j:]
                    break
                path.append(t)
            tokens.append(token)
            if grammar is not None and not grammar.continues(path):
                break
        if not tokens:
            return Draft.empty()
        return Draft(mx.concatenate(tokens), mx.concatenate(qs) if qs else None)

    def accept(self, committed: list[int], target_hidden: Optional[mx.array] = None) -> None:
        """Roll back this round's draft steps, then feed the committed tokens with the rows
        of the round's pass that scored them (`target_hidden` [γ+1, k·H], row i at block
        token i: row i's state precedes committed token i)."""
        if self.cache is None:
            return
        for c in self.cache:
            c.trim(self.stepped)
        self.stepped = 0
        if target_hidden is None:  # no states for what was committed: start over next request
            self.cache, self.seed = None, None
            return
        self._feed(committed, target_hidden[None, : len(committed)])
