"""Model-free drafting by prompt lookup (n-gram matching against the context so far)."""

from __future__ import annotations

import mlx.core as mx

from mlx_spec.drafters import Draft


class NgramDrafter:
    """Proposes the tokens that followed the latest earlier occurrence of the context's
    longest matching suffix (max_ngram down to min_ngram tokens). Costs no model pass;
    q is one-hot, so a proposal is accepted with probability p(x). Strong on inputs that
    get quoted or edited, weak on free text; the γ policy parks it when it does not pay.
    """

    name = "ngram"
    passes_per_token = 0
    rollbackable = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> its last index, with a follower

    def begin(self, prompt_ids: list[int], prompt_cache=None, processor=None) -> int:
        self.tokens = []
        self.latest = {}
        self._extend(prompt_ids)
        return 0

    def _extend(self, ids: list[int]) -> None:
        tokens, latest = self.tokens, self.latest
        for t in ids:
            i = len(tokens)
            # n-grams ending at i-1 now have a follower (t)
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                latest[tuple(tokens[i - n : i])] = i - 1
            tokens.append(t)

    def propose(self, gamma: int, history=None, key=None) -> Draft:
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            end = self.latest.get(tuple(tokens[-n:]))
            if end is not None:
                # Copy what followed, LZ77-style: past the end of the context the copy reads
                # its own output, so a periodic tail (a repeated word, a table row) continues.
                proposal = tokens[end + 1 : end + 1 + gamma]
                while len(proposal) < gamma:
                    proposal.append(proposal[len(proposal) - (len(tokens) - end - 1)])
                return Draft(mx.array(proposal, dtype=mx.uint32))
        return Draft.empty()

    def accept(self, committed: list[int]) -> None:
        self._extend(committed)
