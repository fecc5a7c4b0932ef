"""Model-free drafting by prompt lookup (n-gram matching against the context so far)."""

from __future__ import annotations

import mlx.core as mx

from mlx_spec.core.tree import TreeShape
from mlx_spec.drafters.base import Draft, Drafter


class NgramDrafter(Drafter):
    """Proposes the tokens that followed the latest earlier occurrence of the context's
    longest matching suffix (max_ngram down to min_ngram tokens). Costs no model pass;
    q is one-hot, so a proposal is accepted with probability p(x). Strong on inputs that
    get quoted or edited, weak on free text; the γ policy parks it when it does not pay.

    `propose_tree` branches where the history holds several matches: the continuations of
    up to `branches` earlier occurrences (the longest matching suffix's, latest first, then
    shorter suffixes'), merged where they agree. Its first branch is `propose`'s chain.
    """

    name = "ngram"
    summary = "prompt lookup, no model"
    can_branch = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> "NgramDrafter":
        return cls()  # integer code: every rank of a sharded target runs it alike

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> each index it ends at, with a follower

    def begin(self, prompt_ids: list[int], prompt_cache=None, processor=None) -> int:
        self.reset()
        self._extend(prompt_ids)
        return 0

    def _extend(self, ids: list[int]) -> None:
        tokens, ends = self.tokens, self.ends
        for t in ids:
            i = len(tokens)
            # n-grams ending at i-1 now have a follower (t)
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                ends.setdefault(tuple(tokens[i - n : i]), []).append(i - 1)
            tokens.append(t)

    def propose(self, gamma: int, history=None, key=None) -> Draft:
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            ends = self.ends.get(tuple(tokens[-n:]))
            if ends:
                end = ends[-1]
                return Draft(mx.array(self._continuation(end, gamma), dtype=mx.uint32))
        return Draft.empty()

    def _continuation(self, end: int, gamma: int) -> list[int]:
        # Copy what followed, LZ77-style: past the end of the context the copy reads its own
        # output, so a periodic tail (a repeated word, a table row) continues.
        tokens = self.tokens
        proposal = tokens[end + 1 : end + 1 + gamma]
        while len(proposal) < gamma:
            proposal.append(proposal[len(proposal) - (len(tokens) - end - 1)])
        return proposal

    def propose_tree(self, gamma: int, branches: int, history=None, key=None) -> Draft:
        """A tree of up to `branches` continuations, at most γ deep (see the class)."""
        tokens = self.tokens
        children: dict[int, dict[int, int]] = {}  # node (-1: root) -> {token: child node}
        parents, node_tokens, leaves = [], [], 0
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            # a few more occurrences than branches: some repeat a continuation already in
            for end in reversed(self.ends.get(tuple(tokens[-n:]), [])[-4 * branches:]):
                if leaves == branches:
                    break
                node, grew = -1, False
                for t in self._continuation(end, gamma):
                    child = children.setdefault(node, {}).get(t)
                    if child is None:
                        child = len(parents)
                        parents.append(node)
                        node_tokens.append(t)
                        children[node][t] = child
                        grew = True
                    node = child
                leaves += grew
        if not parents:
            return Draft.empty()
        return Draft(mx.array(node_tokens, dtype=mx.uint32), tree=TreeShape(tuple(parents)))

    def accept(self, committed: list[int], target_hidden=None) -> None:
        self._extend(committed)
