"""What a grammar changes in a round (`mlx_spec.core.grammar` compiles it; this applies it).

Under a grammar every row's logits, the target's and the draft model's, are masked to the
tokens the grammar allows after that row's path, so the acceptance rule runs on the
constrained p and q. A model-free draft is cut at its first token the grammar forbids, and
the tokens the grammar forces after the draft are appended to it as one-hot drafts, which
the target accepts wherever it is forced too. Draft trees are not drawn under a grammar,
nor is a plain round pipelined (the next mask needs this round's token on the host).

`Constraint(None)` is the unconstrained round: every method leaves the round as it is.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from mlx_spec.core.grammar import Matcher
from mlx_spec.core.sampling import one_hot
from mlx_spec.drafters.base import Draft


class Constraint:
    """A request's `Matcher` as the round loop uses it; `matcher` None: no constraint.

    Args:
        matcher: the request's grammar state (`Grammar.matcher()`), or None.
        forced_drafts: append the tokens the grammar forces after a draft as free drafts;
            off, a constrained round verifies only what the drafter proposed.
    """

    def __init__(self, matcher: Optional[Matcher], forced_drafts: bool = True):
        self.matcher = matcher
        self.forced_drafts = forced_drafts

    @property
    def active(self) -> bool:
        return self.matcher is not None

    def cut(self, draft: Draft, room: int) -> tuple[Draft, int, Optional[Callable[[], mx.array]]]:
        """Step 2b: the draft cut before its first token the grammar forbids (or an EOS),
        then the run the grammar forces after it (up to `room` tokens in all), appended with
        one-hot q. Returns (the draft, how many of its tokens the drafter proposed, a
        function giving the block's masks [γ+1, V], row i allowing what may follow
        x_1..x_i; None unconstrained)."""
        if self.matcher is None:
            return draft, draft.tokens.shape[0], None
        grammar = self.matcher
        x = draft.tokens.tolist()
        x = x[: min(grammar.valid_prefix(x), room)]
        forced = grammar.forced(x, room - len(x)) if self.forced_drafts and grammar.continues(x) else []
        path = x + forced
        q = draft.q
        if q is not None:
            q = q[: len(x)]
            if forced:
                q = mx.concatenate([q, one_hot(mx.array(forced), q.shape[-1], q.dtype)])
        return (Draft(mx.array(path, dtype=mx.uint32), q, forwards=draft.forwards), len(x),
                lambda: grammar.path_masks(path))

    def until_complete(self, emitted: list[int]) -> list[int]:
        """Nothing after the value's end (plain decoding stops there too)."""
        return emitted if self.matcher is None else self.matcher.until_complete(emitted)

    def commit(self, emitted: list[int]) -> bool:
        """The round committed `emitted`; returns whether the value is now complete (only
        EOS could follow, so generation stops)."""
        if self.matcher is None:
            return False
        self.matcher.commit(emitted)
        return self.matcher.stopped
