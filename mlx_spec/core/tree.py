"""The shape of a draft tree, for the verify pass, the acceptance rule and the statistics.

A tree drafts several continuations at once (SpecInfer, Miao et al. 2024). Its nodes are
draft tokens in topological order: `parents[i]` is the node that token i follows, or -1 for
the round's last committed token (the root). The verify pass feeds the flattened block
[root, x_0..x_N-1], so block row 0 is the root and row i+1 is node i; each row attends to
the prefix and its own ancestors only, at position prefix + depth. Children of one node are
its siblings, tried in index order: a node's sibling rank is how many come before it.

A chain is the tree whose parents are -1, 0, 1, ..., γ-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import mlx.core as mx


@dataclass(frozen=True)
class TreeShape:
    parents: tuple[int, ...]  # parent node per node, -1 = the root

    def __post_init__(self):
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} must come before it (or be -1)")

    @staticmethod
    def chain(gamma: int) -> "TreeShape":
        return TreeShape(tuple(range(-1, gamma - 1)))

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> list[int]:
        """Depth per node: 1 for the root's children."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    @cached_property
    def rank(self) -> list[int]:
        """Sibling rank per node: earlier children of the same parent."""
        seen: dict[int, int] = {}
        ranks = []
        for parent in self.parents:
            ranks.append(seen.get(parent, 0))
            seen[parent] = ranks[-1] + 1
        return ranks

    # Small host tables as nested lists (numpy stays out of the CLI's imports), and the
    # device arrays the mask and the acceptance rule read, built once per shape.

    @cached_property
    def ancestors(self) -> list[list[bool]]:
        """[N+1][N+1] over block rows: [r][c] when row c is row r or an ancestor of it."""
        rows = [[c == 0 for c in range(self.size + 1)]]
        for i, parent in enumerate(self.parents):
            row = list(rows[parent + 1])
            row[i + 1] = True
            rows.append(row)
        return rows

    @cached_property
    def earlier_siblings(self) -> list[list[bool]]:
        """[N][N] over nodes: [i][j] when j is a sibling tried before i."""
        p = self.parents
        return [[j < i and p[j] == p[i] for j in range(self.size)] for i in range(self.size)]

    @cached_property
    def children(self) -> list[list[bool]]:
        """[N+1][N]: [r][j] when node j is a child of block row r."""
        return [[parent + 1 == r for parent in self.parents] for r in range(self.size + 1)]

    @cached_property
    def device(self) -> dict[str, mx.array]:
        """The tables on the device: node ancestors [N, N] and earlier siblings [N, N] (bool),
        children [N+1, N] and earlier siblings as float32 (for matmuls), depth [N], later
        siblings (rank > 0) [N] as bool and float32, each block row's first child [N+1] (N
        where it has none)."""
        nodes = [row[1:] for row in self.ancestors[1:]]
        later = [k > 0 for k in self.rank]
        first_child = [next((j for j, on in enumerate(row) if on), self.size) for row in self.children]
        return {
            "ancestors": mx.array(nodes), "earlier": mx.array(self.earlier_siblings),
            "earlier_f": mx.array(self.earlier_siblings, mx.float32),
            "children_f": mx.array(self.children, mx.float32), "depth": mx.array(self.depth),
            "later": mx.array(later), "later_f": mx.array(later, mx.float32),
            "first_child": mx.array(first_child),
        }

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (empty for the root, -1)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def attempts(self, path: Sequence[int]) -> list[tuple[int, int, bool]]:
        """(depth, sibling rank, accepted) for every node whose turn came in a round that
        accepted `path`: at each node of the path (the root first), its children in rank
        order up to the accepted one, or all of them where none was."""
        out = []
        for level, parent in enumerate([-1, *path]):
            taken = path[level] if level < len(path) else None
            for j in (j for j, child in enumerate(self.children[parent + 1]) if child):
                out.append((self.depth[j], self.rank[j], j == taken))
                if j == taken:
                    break
        return out

    def subtree(self, keep: Sequence[int]) -> "TreeShape":
        """The tree of the nodes `keep` (ascending, closed under parents), renumbered."""
        new = {old: i for i, old in enumerate(keep)}
        return TreeShape(tuple(-1 if self.parents[k] < 0 else new[self.parents[k]] for k in keep))


def tree_mask(shape: TreeShape, prior: int, window: Optional[int] = None) -> mx.array:
    """Attention mask [N+1, prior + N+1] (True = attend) for the flattened block after `prior`
    cached keys whose positions end just before the root's: each row sees the prefix (within
    its sliding `window`, if any, at position root + depth) and its own ancestors."""
    depth = mx.array([0, *shape.depth])
    block = mx.array(shape.ancestors)
    if window is None:
        prefix = mx.ones((shape.size + 1, prior), dtype=mx.bool_)
    else:
        # a key `back` positions before the root is within the window of a row at depth d
        back = mx.arange(prior, 0, -1)
        prefix = back[None, :] < window - depth[:, None]
        block = block & (depth[:, None] - depth[None, :] < window)
    return mx.concatenate([prefix, block], axis=1)
