"""Sampling: logits → the processed distribution, kept apart from drawing a token.

The acceptance rule is exact for the distributions actually sampled, so the target's p and
the draft's q go through the same `LogitProcessor` with the same token history. Processing
order: repetition penalty → temperature → top-k → top-p → min-p → renormalise.

Randomness comes only from explicit PRNG keys, so a seed reproduces a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlx_spec.errors import UsageError

NO_TOKEN = 2**31 - 1  # pads penalty windows; past every vocabulary, so never penalized
# `LogitProcessor.greedy`'s answer for a row it leaves to the exact pass (past every
# vocabulary, so no draft token equals it; the same as int32 and as uint32)
UNDECIDED = 2**31 - 2
MANTISSA_BITS = {mx.float32: 23, mx.bfloat16: 7, mx.float16: 10}


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy (argmax) decoding.

    top_k 0, top_p 1.0, min_p 0.0 and repetition_penalty 1.0 each mean "off".
    repetition_context is how many recent tokens the penalty looks at.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: Optional[int] = None

    def __post_init__(self):
        checks = [  # (ok, message, the flag that sets the value)
            (self.temperature >= 0 and math.isfinite(self.temperature), "temperature must be >= 0", "--temp"),
            (self.top_k >= 0, "top-k must be >= 0 (0 turns it off)", "--top-k"),
            (0.0 < self.top_p <= 1.0, "top-p must be in (0, 1]", "--top-p"),
            (0.0 <= self.min_p < 1.0, "min-p must be in [0, 1)", "--min-p"),
            (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
             "repetition penalty must be > 0 and finite", "--repetition-penalty"),
            (self.repetition_context >= 1, "repetition context must be >= 1", None),
            (self.seed is None or 0 <= self.seed < 2**64, "seed must be between 0 and 2^64 - 1", "--seed"),
        ]
        for ok, message, flag in checks:
            if not ok:
                raise UsageError(message, flag=flag)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0


class LogitProcessor:
    """Applies `SamplingParams` to rows of logits.

    Row i of a block is conditioned on `history + block[:i]`; the repetition penalty looks
    at the last `repetition_context` tokens of exactly that, for p and q alike. `constraint`:
    the request's grammar state (`mlx_spec.core.grammar.Matcher`), whose masks p's rows and q's
    rows both get.
    """

    def __init__(self, params: SamplingParams, constraint=None):
        self.params = params
        self.constraint = constraint
        # A full sort of a 262k vocabulary takes ~100 ms for 4 rows on a CPU: there, look
        # for the nucleus among the 1024 likeliest tokens first (one extra host check). A
        # GPU sorts quickly, and a host check would stall its queue, so it sorts everything.
        self.nucleus_head = 1024 if mx.default_device() == mx.cpu else None
        # MLX's exp on a CPU takes ~4 ms a row of Gemma's 262,144 logits (~0.3 ms for an
        # argmax): there `greedy` forms the log-probs only where they can change the answer.
        self.exact_everywhere = mx.default_device() != mx.cpu

    def windows(
        self, history: list[int], block: Optional[mx.array], rows: int, first: int = 0
    ) -> Optional[mx.array]:
        """Token windows [rows - first, C] for the repetition penalty, or None when it is off.

        Row i holds the last C tokens of history + block[:i]; while that is shorter than C,
        the row is padded with `NO_TOKEN`, which `penalize` ignores.

        Args:
            history: committed token ids (host).
            block: tokens that follow the history in this block (lazy); row i sees block[:i].
            rows: rows of the block; `first` skips the leading ones.
        """
        if not self.params.penalized or not history:
            return None
        C = self.params.repetition_context
        tokens = self._recent(history)
        if rows > 1:
            tokens = mx.concatenate([tokens, block[: rows - 1].astype(mx.uint32)])
        index = mx.arange(first, rows)[:, None] + mx.arange(C)[None, :]
        return tokens[index]

    def tree_windows(self, history: list[int], x: mx.array, shape) -> Optional[mx.array]:
        """Penalty windows [N+1, C] for a draft tree's block rows (see `mlx_spec.core.tree`): the
        root's row sees the history, node i's row the history and its path to node i."""
        if not self.params.penalized or not history:
            return None
        C = self.params.repetition_context
        tokens = mx.concatenate([self._recent(history), x.astype(mx.uint32)])
        rows = [list(range(C))] + [(list(range(C)) + [C + j for j in shape.path(i)])[-C:]
                                   for i in range(shape.size)]
        return tokens[mx.array(rows)]

    def _recent(self, history: list[int]) -> mx.array:
        """The penalty's window over the history alone [C]: its last C tokens, led by
        `NO_TOKEN` while it is shorter."""
        C = self.params.repetition_context
        recent = history[-C:]
        return mx.array([NO_TOKEN] * (C - len(recent)) + recent, dtype=mx.uint32)

    def penalize(self, logits: mx.array, windows: Optional[mx.array]) -> mx.array:
        """Apply the repetition penalty to the ids in each row's window. Ids past the width
        of `logits` (padding, or ids a narrower draft vocabulary lacks) are ignored: they
        go to a scratch column, since MLX does not bounds-check gathers."""
        if windows is None:
            return logits
        penalty = self.params.repetition_penalty
        V = logits.shape[-1]
        scratch = mx.concatenate([logits, mx.zeros((logits.shape[0], 1), logits.dtype)], axis=-1)
        index = mx.minimum(windows, V)
        seen = mx.take_along_axis(scratch, index, axis=-1)
        seen = mx.where(seen < 0, seen * penalty, seen / penalty)
        return mx.put_along_axis(scratch, index, seen, axis=-1)[:, :V]

    def greedy(self, logits: mx.array, windows: Optional[mx.array] = None, settle: bool = False) -> mx.array:
        """The target's tokens [rows] at temperature 0 for logits [rows, V], as mlx-lm's
        `generate_step` chooses them: the argmax of the log-probs, logits − logsumexp in
        the logits' dtype. Two logits less than a rounding step apart tie there, and the
        lower id wins, where a raw argmax would pick the larger logit.

        The log-probs cost a pass of exp over the row, slow on a CPU. There a row whose top
        logit is further above every other than the log-probs' rounding step (`tie_step`)
        gets its raw argmax, the same token, and any other row gets `UNDECIDED`; `settle`
        forms the log-probs of every row and decides all of them. No draft token equals
        `UNDECIDED`, so a verdict stops at the first such row it reaches, and the engine
        asks for `settle` only when one does."""
        logits = self.penalize(logits, windows)
        if settle or self.exact_everywhere:
            return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
        top = mx.max(logits, axis=-1, keepdims=True)
        contested = mx.sum(logits >= top - tie_step(logits.dtype, logits.shape[-1]), axis=-1) > 1
        return mx.where(contested, mx.array(UNDECIDED, mx.uint32), mx.argmax(logits, axis=-1))

    def likeliest(self, logits: mx.array, windows: Optional[mx.array] = None) -> mx.array:
        """The argmax tokens [rows] of the penalized logits: a draft's guess, which need not
        break ties as the target's tokens must."""
        return mx.argmax(self.penalize(logits, windows), axis=-1)

    def distribution(self, logits: mx.array, windows: Optional[mx.array] = None) -> mx.array:
        """Probabilities [rows, V] (float32) of logits [rows, V] after all processing."""
        params = self.params
        logits = self.penalize(logits.astype(mx.float32), windows)
        logits = logits / max(params.temperature, 1e-6)
        V = logits.shape[-1]
        if 0 < params.top_k < V:
            kth = mx.min(mx.topk(logits, params.top_k, axis=-1), axis=-1, keepdims=True)
            logits = mx.where(logits < kth, -mx.inf, logits)
        probs = mx.softmax(logits, axis=-1)
        if params.top_p < 1.0:
            probs = mx.where(probs < self._nucleus_floor(probs), 0.0, probs)
        if params.min_p > 0.0:
            floor = params.min_p * mx.max(probs, axis=-1, keepdims=True)
            probs = mx.where(probs < floor, 0.0, probs)
        return probs / mx.sum(probs, axis=-1, keepdims=True)

    def _nucleus_floor(self, probs: mx.array) -> mx.array:
        """The smallest probability kept by top-p, per row [rows, 1].

        With a `nucleus_head`, the nucleus is first sought among that many likeliest tokens;
        only a distribution too flat for that (checked on the host) pays for the full sort.
        """
        top_p = self.params.top_p
        head = min(probs.shape[-1], self.nucleus_head or probs.shape[-1])
        ordered = -mx.sort(-mx.topk(probs, head, axis=-1), axis=-1)
        if head < probs.shape[-1] and not mx.all(mx.sum(ordered, axis=-1) >= top_p).item():
            ordered = -mx.sort(-probs, axis=-1)
        before = mx.cumsum(ordered, axis=-1) - ordered
        # the token that carries the mass past top_p is kept, hence `before < top_p`
        return mx.min(mx.where(before < top_p, ordered, mx.inf), axis=-1, keepdims=True)


def tie_step(dtype, width: int) -> float:
    """How close to the top logit another must be for their log-probs to round equal. The
    log-probs are x − c, c = logsumexp ≥ max, and c − max ≤ log(width), so those of the
    logits within 2 of the top are at most log(width) + 2 in size, and two of them round
    equal only within the spacing of `dtype` there. Twice that spacing, to spare the
    argument's edges."""
    bits = MANTISSA_BITS.get(dtype, 23)
    return 2.0 * 2.0 ** (math.floor(math.log2(math.log(max(width, 2)) + 2.0)) - bits)


def likeliest(values: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest entries of each row of values [rows, V] (probabilities, log-probs):
    their ids and values, largest first ([rows, k] each; a partition, then a sort of k,
    not of the vocabulary)."""
    ids = mx.argpartition(-values, k - 1, axis=-1)[:, :k]
    top = mx.take_along_axis(values, ids, axis=-1)
    order = mx.argsort(-top, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(top, order, axis=-1)


def one_hot(tokens: mx.array, width: int, dtype=mx.float32) -> mx.array:
    """[n, width]: row i is 1 at tokens[i] ([n]) and 0 elsewhere; the q of a drafted token
    chosen deterministically (a model-free draft, a sibling, a token a grammar forces).
    An id outside [0, width) gives a row of zeros."""
    return (mx.arange(width)[None, :] == tokens.reshape(-1, 1)).astype(dtype)


def draw(probs: mx.array, key: mx.array) -> mx.array:
    """One token per row of probs [rows, V] (or one token for a [V] vector)."""
    return mx.random.categorical(mx.log(probs), key=key)


def make_key(seed: Optional[int]) -> mx.array:
    """A PRNG key from a seed; no seed draws one from the OS."""
    if seed is None:
        import secrets

        seed = secrets.randbits(63)
    return mx.random.key(seed)
