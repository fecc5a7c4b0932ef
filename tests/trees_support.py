"""Shared by several test modules; moved from test_trees.py."""

import mlx.core as mx

from mlx_spec.core.cost_model import CostCurve
from mlx_spec.core.policy import TreePolicy
from mlx_spec.core.tree import TreeShape
from mlx_spec.drafters import Draft, Drafter

# Four earlier occurrences of 40 41 42, each followed by something else: the n-gram drafter
# branches at the end of the prompt.
BRANCHING_PROMPT = [2, 40, 41, 42, 50, 40, 41, 42, 51, 60, 40, 41, 42, 52, 40, 41, 42, 53, 61, 62, 40, 41, 42]


LONG_BRANCHING = [2] + [(7 * i) % 250 + 6 for i in range(30)] + BRANCHING_PROMPT[1:]  # past the window


def flat_policy(**kwargs):
    """Width costs nothing: the cut keeps every node the drafter proposes."""
    return TreePolicy(CostCurve([0.01] * 17, 0.0, 256), learn_costs=False, **kwargs)


class SecondSiblingDrafter(Drafter):
    """Test drafter: a tree whose right answer is never the first child. At each of
    `depth` levels it proposes a decoy token first, then the reference's next token, and a
    decoy child under each decoy but the deepest; so every accepted path runs through rank-1 nodes and is
    never a prefix of the flattened block. `reference`: the greedy output it peeks at."""

    name, can_branch = "second-sibling", True

    def __init__(self, prompt, reference, depth=3):
        self.prompt, self.reference, self.depth = list(prompt), reference, depth

    def begin(self, prompt_ids, prompt_cache=None, processor=None):
        self.done = 0
        return 0

    def propose(self, gamma, history, key=None):
        return Draft.empty()

    def propose_tree(self, gamma, branches, history, key=None):
        done = len(history) - len(self.prompt)
        right = self.reference[done : done + min(gamma, self.depth)]
        parents, tokens, node = [], [], -1
        for level, t in enumerate(right):
            decoy = (t + 1) % 250 + 6
            parents.append(node)
            tokens.append(decoy)
            if level + 1 < len(right):  # the decoy's child, within γ
                parents.append(len(parents) - 1)
                tokens.append((decoy + 7) % 250 + 6)
            parents.append(node)  # the right token, second child
            tokens.append(t)
            node = len(parents) - 1
        if not tokens:
            return Draft.empty()
        return Draft(mx.array(tokens, mx.uint32), tree=TreeShape(tuple(parents)))

    def accept(self, committed, target_hidden=None):
        pass
