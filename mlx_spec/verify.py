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
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx

from mlx_spec.sampling import draw


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
        q_n = (mx.arange(V) == x_n).astype(p.dtype)
    else:
        q_n = mx.take(mx.concatenate([q, mx.zeros((1, V), q.dtype)]), n, axis=0)
    residual = mx.maximum(p_n - q_n, 0.0)
    mass = mx.sum(residual)
    # mass is > 0 whenever a rejection can happen; the guard only covers float round-off.
    final = mx.where(mass > 0, residual / mass, p_n)
    return Verdict(n, draw(final, key_token))
