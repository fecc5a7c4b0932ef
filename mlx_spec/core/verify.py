"""The acceptance rule, and nothing else.

Names as in Leviathan, Kalman & Matias (ICML 2023), Algorithm 1; token names as in vLLM:
  p                target distributions,   [γ+1, V]: row i scores draft token i+1
  q                draft distributions,    [γ, V]; None for model-free drafts (q is one-hot)
  x                draft tokens,           [γ]
  n                accepted draft tokens:  the length of the accepted prefix of x
  recovered token  drawn from norm(max(0, p_n − q_n)) at the first rejection (n < γ)
  bonus token      drawn from p_γ+1 when all γ draft tokens are accepted (n = γ)

Every round emits x_1..x_n plus one recovered-or-bonus token, and the emitted tokens are
distributed exactly as if drawn from p alone (Appendix A.1). At temperature 0 the rule
reduces to "accept while the draft token is the target's argmax".

Both rules stay on the device and return a lazy `Verdict`; the engine synchronises once per
round on it.

On a draft tree (`mlx_spec.core.tree`; SpecInfer's multi-step speculative sampling, Miao et al.
2024) the walk starts at the root: its children are tried in rank order, the first accepted
one becomes the next node, and where all are rejected, or at a leaf, the recovered or bonus
token ends the round. A node's first child may carry the q it was sampled from (a draft
model's chain); every other node is one-hot (drafters choose siblings deterministically).
At each node the first child gets Leviathan's test (r·q(x) < p(x); one-hot: r < p(x)); if
it is rejected, the output must be distributed as the residual p' = norm(max(p − q, 0))
whatever that child was, so the later siblings x_k are one-hot drafts against p': each
accepted with probability p'(x_k) over the mass of p' not yet rejected, and where all are
rejected the recovered token is drawn from p' with them zeroed. Each step is exact for p
(Appendix A.1, then again with one-hot q on p'); with one-hot q throughout this is
SpecInfer's rule for deterministic siblings.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx

from mlx_spec.core.sampling import draw, one_hot
from mlx_spec.core.tree import TreeShape


class Verdict(NamedTuple):
    """A round's outcome, lazy on the device until the round's one host sync."""

    n: mx.array  # accepted draft tokens, a scalar
    token: mx.array  # the recovered (n < γ) or bonus (n = γ) token, a scalar


def accepted_prefix(accepted: mx.array) -> mx.array:
    """n: how many leading entries of the boolean vector `accepted` are true."""
    return mx.sum(mx.cumprod(accepted.astype(mx.int32)))


def verify_greedy(x: mx.array, target_tokens: mx.array) -> Verdict:
    """Greedy verification: accept while the draft token is the target's argmax.

    Args:
        x: draft tokens [γ].
        target_tokens: the target's argmax at each of the γ+1 positions [γ+1].
    Returns:
        The `Verdict`: n accepted, and the target's own token after them.
    """
    if x.shape[0] == 0:  # a plain round: no prefix to compute (fewer ops per token)
        return Verdict(mx.array(0), target_tokens[0])
    n = accepted_prefix(x == target_tokens[: x.shape[0]].astype(x.dtype))
    return Verdict(n, mx.take(target_tokens, n))


def verify_sampled(x: mx.array, q: Optional[mx.array], p: mx.array, key: mx.array) -> Verdict:
    """Leviathan verification at temperature > 0.

    Args:
        x: draft tokens [γ].
        q: draft distributions [γ, V], or None when x came from a model-free drafter.
        p: target distributions [γ+1, V], processed exactly as q was.
        key: PRNG key for this round's acceptance draws and the final token.
    Returns:
        The `Verdict`: n accepted, and the recovered (n < γ) or bonus (n = γ) token.
    """
    gamma, V = x.shape[0], p.shape[-1]
    key_accept, key_token = mx.random.split(key)
    if gamma == 0:
        return Verdict(mx.array(0), draw(p[0], key_token))

    p_x = mx.take_along_axis(p[:gamma], x[:, None], axis=-1)[:, 0]
    q_x = mx.ones((gamma,)) if q is None else mx.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    # Accept x_i if q(x_i) <= p(x_i); otherwise accept with probability p(x_i) / q(x_i).
    # r < p/q written as r·q < p, so q(x_i) <= p(x_i) always passes (r < 1).
    r = mx.random.uniform(shape=(gamma,), key=key_accept)
    n = accepted_prefix(r * q_x < p_x)

    # Row n of [q; 0] is q_n at a rejection and zero for the bonus position, so one
    # expression gives both the recovered and the bonus distribution.
    p_n = mx.take(p, n, axis=0)
    if q is None:
        x_n = mx.take(mx.concatenate([x.astype(mx.int32), mx.array([-1])]), n)
        q_n = one_hot(x_n, V, p.dtype)[0]
    else:
        q_n = mx.take(mx.concatenate([q, mx.zeros((1, V), q.dtype)]), n, axis=0)
    residual = mx.maximum(p_n - q_n, 0.0)
    mass = mx.sum(residual)
    # mass is > 0 whenever a rejection can happen; the guard only covers float round-off.
    final = mx.where(mass > 0, residual / mass, p_n)
    return Verdict(n, draw(final, key_token))


class TreeVerdict(NamedTuple):
    """A tree round's outcome, lazy until the round's sync."""

    n: mx.array  # accepted nodes: the length of the accepted path, a scalar
    token: mx.array  # the recovered or bonus token after the path, a scalar
    path: mx.array  # [N] bool: the nodes on the accepted path


def _walk(shape: TreeShape, first: mx.array):
    """The accepted path from the nodes each first accepted among their siblings ([N]
    bool): a node is on it when it and all its ancestors were. Returns (n, path, the block
    row the path ends at)."""
    tables = shape.device
    path = ~mx.any(tables["ancestors"] & ~first[None, :], axis=1)
    n = mx.sum(path)
    end = mx.where(n > 0, 1 + mx.argmax(mx.where(path, tables["depth"], 0)), 0)
    return n, path, end


def first_among_siblings(shape: TreeShape, accepted: mx.array) -> mx.array:
    """[N] bool: accepted, and no sibling tried before it was."""
    return accepted & ~mx.any(shape.device["earlier"] & accepted[None, :], axis=1)


def verify_tree_greedy(x: mx.array, shape: TreeShape, target_tokens: mx.array) -> TreeVerdict:
    """Greedy verification of a tree: the longest root path of target-argmax tokens.

    Args:
        x: node tokens [N]; shape: their tree.
        target_tokens: the target's argmax at every block row [N+1].
    """
    parent_rows = mx.array(shape.parents) + 1
    accepted = x == mx.take(target_tokens, parent_rows).astype(x.dtype)
    n, path, end = _walk(shape, first_among_siblings(shape, accepted))
    return TreeVerdict(n, mx.take(target_tokens, end), path)


def verify_tree_sampled(x: mx.array, shape: TreeShape, p: mx.array, key: mx.array,
                        q: Optional[mx.array] = None) -> TreeVerdict:
    """Recursive rejection sampling over a draft tree (see the module docstring).

    Args:
        x: node tokens [N]; shape: their tree.
        p: target distributions at every block row [N+1, V] (row 0: the root).
        key: PRNG key for the acceptance draws and the final token.
        q: draft distributions [N, V] the first children (rank 0) were sampled from, or None
            (all one-hot); rows of later siblings must be one-hot at their tokens.
    """
    N, V = shape.size, p.shape[-1]
    tables = shape.device
    key_accept, key_token = mx.random.split(key)
    x = x.astype(mx.int32)
    if q is None:
        q = one_hot(x, V, p.dtype)
    parent_rows = mx.array(shape.parents) + 1
    # Per block row: the residual once its first child is rejected, p' = norm(max(p − q, 0)).
    q_first = mx.take(mx.concatenate([q, mx.zeros((1, V), q.dtype)]), tables["first_child"], axis=0)
    residual = mx.maximum(p - q_first, 0.0)
    mass = mx.sum(residual, axis=-1, keepdims=True)
    p_rest = mx.where(mass > 0, residual / mass, p)  # a guard against float round-off
    p_x = mx.take(p.reshape(-1), parent_rows * V + x)  # p_parent(x) [N]
    q_x = mx.take(q.reshape(-1), mx.arange(N) * V + x)
    rest_x = mx.take(p_rest.reshape(-1), parent_rows * V + x) * tables["later_f"]  # 0 for first children
    r = mx.random.uniform(shape=(N,), key=key_accept)
    # First children: r·q(x) < p(x). Later ones: r < p'(x_k) / (1 − p' of earlier later siblings).
    accepted = mx.where(tables["later"], r * (1.0 - tables["earlier_f"] @ rest_x) < rest_x, r * q_x < p_x)
    n, path, end = _walk(shape, first_among_siblings(shape, accepted))
    # At the end row every child was rejected: p' there with the later children zeroed; at a
    # leaf, p itself (no first child: p' = p), the bonus distribution.
    p_end = mx.take(p_rest, end, axis=0)
    kept = 1.0 - mx.take(shape.device["children_f"], end, axis=0) * tables["later_f"]
    final = p_end.at[x].multiply(kept)
    final_mass = mx.sum(final)
    final = mx.where(final_mass > 0, final / final_mass, mx.take(p, end, axis=0))
    return TreeVerdict(n, draw(final, key_token), path)


def verify_block(x: mx.array, tree: Optional[TreeShape], q: Optional[mx.array], *,
                 target_tokens: Optional[mx.array] = None, p: Optional[mx.array] = None,
                 key: Optional[mx.array] = None) -> "Verdict | TreeVerdict":
    """The rule for a round's draft, a chain (`tree` None) or a tree: greedy given the
    target's tokens at every block row, else Leviathan's given p and the round's `key`."""
    if target_tokens is not None:
        return verify_greedy(x, target_tokens) if tree is None else verify_tree_greedy(x, tree, target_tokens)
    return verify_sampled(x, q, p, key) if tree is None else verify_tree_sampled(x, tree, p, key, q)
