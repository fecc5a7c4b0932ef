"""Model-free drafting from everything already written: suffix decoding (SuffixDecoding,
Oliaro et al. 2024, arXiv 2411.04975; Arctic Inference, vLLM's "suffix" method).

The drafter looks the context's last tokens up in two `token_memory` indexes: this
request's prompt and output so far (updated as each round commits), and a bounded memory
of earlier requests' prompts and outputs (shared by every request of a server or a chat
session; `fork(memory=...)` gives a request another, or none). The occurrences whose
preceding tokens match the context longest vote on what comes next, the latest loudest
(this request's before the memory's, each vote `recency` times the one after it): a
continuation's probability is the share of those votes that continued so (the suffix
tree's count over its parent's, recency-weighted), multiplied down the draft; it stops
below `min_prob`. With `recency` 0.5 the latest occurrence outvotes all older ones
together, as the n-gram drafter's latest match does: text that loops or a file edited
turn after turn continues as it did last, where plain counts followed the older majority
(bench/suffix_replay.py: the editing turn where suffix lost a forward to n-gram). Its length is
capped by the match's (`factor` · match + `offset`, and γ): a long match earns a long
draft, a two-token one a short draft. `propose_tree` expands the likeliest nodes best
first, so where earlier text continued several ways, each way is verified.

q is one-hot (None), as for the n-gram drafter: exact at any temperature. Each drafted
token is tagged with where it was found (`Draft.sources`): "context" where this request's
own text has it, else "memory", and the statistics count both apart.
"""

from __future__ import annotations

import heapq
from typing import Optional

import mlx.core as mx

from mlx_spec.core.drafter import KEEP, Draft, Drafter
from mlx_spec.core.tree import TreeShape
from mlx_spec.drafters.token_memory import SEPARATOR, Memories, TokenIndex

CONTEXT, MEMORY = "context", "memory"


class SuffixDrafter(Drafter):
    """See the module. Args: `memories` (the pool whose shared memory it starts with; a
    new one of a million tokens if None), `depth` (context tokens a match is measured
    over), `limit` (occurrences measured per index and lookup), `factor`/`offset` (the draft
    length cap from the match length), `min_prob` (the least estimated probability a
    drafted token may have), `recency` (each older occurrence's vote over the next newer's:
    1 counts them alike, as SuffixDecoding does)."""

    name = "suffix"
    summary = "suffix lookup in this request's and earlier requests' text, no model"
    can_branch = True
    remembers = True

    def __init__(self, memories: Optional[Memories] = None, *, depth: int = 32, limit: int = 48,
                 factor: float = 1.0, offset: float = 3.0, min_prob: float = 0.1, recency: float = 0.5):
        self.memories = Memories() if memories is None else memories
        self.memory = self.memories.get()
        self.depth, self.limit = depth, limit
        self.factor, self.offset, self.min_prob, self.recency = factor, offset, min_prob, recency
        self.reset()

    @classmethod
    def for_pair(cls, pair, world) -> "SuffixDrafter":
        return cls()  # integer code: every rank of a sharded target runs it alike

    def reset(self) -> None:
        self.context = TokenIndex(4096, bucket_bits=16, growable=True)
        self.prompt: Optional[list[int]] = None  # the request's, until it is remembered
        self.output: list[int] = []

    def fork(self, memory=KEEP) -> "SuffixDrafter":
        twin = super().fork()
        if memory is not KEEP:
            twin.memory = memory
        return twin

    def begin(self, prompt_ids: list[int], prompt_cache=None, processor=None) -> int:
        self.reset()
        self.prompt = list(prompt_ids)
        self.context.extend(self.prompt)
        return 0

    def accept(self, committed: list[int], target_hidden=None) -> None:
        self.context.extend(committed)
        self.output += committed

    def end(self) -> None:
        if self.memory is not None and self.prompt is not None:
            self.memory.remember(self.prompt, self.output)
        self.prompt, self.output = None, []

    # -- drafting ---------------------------------------------------------------------------

    def propose(self, gamma: int, history=None, key=None) -> Draft:
        return self._draft(gamma, branches=1)

    def propose_tree(self, gamma: int, branches: int, history=None, key=None) -> Draft:
        return self._draft(gamma, branches)

    def _draft(self, gamma: int, branches: int) -> Draft:
        rows, weights, own, longest = self._continuations(gamma)
        if not rows:
            return Draft.empty()
        cap = min(gamma, int(self.factor * longest + self.offset))
        tokens, parents, sources = _best_first(rows, weights, own, cap, self.min_prob,
                                               max_nodes=cap * max(branches, 1), max_leaves=max(branches, 1))
        if not tokens:
            return Draft.empty()
        chain = parents == list(range(-1, len(parents) - 1))
        return Draft(mx.array(tokens, dtype=mx.uint32), tree=None if chain else TreeShape(tuple(parents)),
                     sources=tuple(sources))

    def _continuations(self, length: int):
        """The distinct continuations (tuples, cut at their end) of the longest matches in
        both indexes, latest first (this request's before the memory's), how many
        occurrences had each, whether this request's text has each, and the match length."""
        context = self.context
        tail = context.tokens[max(0, context.end - self.depth) : context.end].tolist()  # growable: slot = position
        found = [(context.lookup(tail, self.depth, length, self.limit, periodic=True), True)]
        if self.memory is not None and len(self.memory):
            found.append((self.memory.lookup(tail, self.depth, length, self.limit), False))
        longest = max((int(m.lengths.max()) for m, _ in found if m.lengths.size), default=0)
        counts: dict[tuple, float] = {}
        own: dict[tuple, bool] = {}
        rank = 0  # of the occurrences that continue, latest first: this request's, then the memory's
        for matches, is_context in found:
            if not matches.lengths.size:
                continue
            # the occurrences under the suffix tree's deepest matching node
            for row in matches.follow[matches.lengths >= longest].tolist():
                row = tuple(row[: row.index(SEPARATOR)] if SEPARATOR in row else row)
                if not row:
                    continue  # a remembered request ended there: nothing to draft
                counts[row] = counts.get(row, 0) + self.recency ** rank
                own[row] = own.get(row, False) or is_context
                rank += 1
        rows = list(counts)
        return rows, [counts[r] for r in rows], [own[r] for r in rows], longest


def _best_first(rows: list[tuple], weights: list[int], own: list[bool], depth: int, min_prob: float,
                max_nodes: int, max_leaves: int) -> tuple[list[int], list[int], list[str]]:
    """The draft tree, at most `depth` deep, of the continuations `rows` (row i seen
    weights[i] times, latest first): its likeliest nodes, best first (Arctic's tree
    speculation), a node's probability its parent's times the share of the parent's weight
    that went on with its token, none below `min_prob`; at most `max_nodes` nodes and
    `max_leaves` leaves (1: the likeliest chain). Returns (tokens, parents, sources) with
    parents before children and likelier siblings first; ties go to the latest occurrence."""
    tokens, parents, sources = [], [], []
    leaves, has_child = 0, set()
    heap: list = []

    def push_children(node: int, at: int, members: list[int], probability: float) -> None:
        if at == depth:
            return
        total = sum(weights[i] for i in members)
        groups: dict[int, list[int]] = {}
        for i in members:
            if at < len(rows[i]):
                groups.setdefault(rows[i][at], []).append(i)
        for token, group in groups.items():
            p = probability * sum(weights[i] for i in group) / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, group[0], node, at + 1, token, group))

    push_children(-1, 0, list(range(len(rows))), 1.0)
    while heap and len(tokens) < max_nodes:
        negative, _, parent, at, token, members = heapq.heappop(heap)
        if parent in has_child:  # a sibling: one more leaf
            if leaves >= max_leaves:
                continue
            leaves += 1
        elif not tokens:
            leaves = 1
        has_child.add(parent)
        tokens.append(token)
        parents.append(parent)
        sources.append(CONTEXT if any(own[i] for i in members) else MEMORY)
        push_children(len(tokens) - 1, at, members, -negative)
    return tokens, parents, sources
