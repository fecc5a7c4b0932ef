"""The cost model speculation is decided by, with nothing measured here: a target forward's
seconds by width and a draft step's (`CostCurve`), the same corrected by the rounds that ran
(`LiveCosts`), and the weight bytes a forward reads. `mlx_spec.apps.calibration` measures the curves on
models; the policy reads them through this module, which imports nothing else of ours.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from mlx.utils import tree_flatten


@dataclass
class CostCurve:
    """Seconds per target forward by width (verify[w - 1] for w positions), per draft step,
    and per two-token draft step, measured at `context` tokens of context; `wide`: (width,
    seconds) measured at a few widths past `verify`'s, the rows a batch's forward reaches
    (`serve --parallel`).

    The two-token step happens after a fully accepted round: the draft has not yet seen its
    own last token x_γ and feeds it together with the bonus token.
    """

    verify: list[float]
    draft_step: float
    context: int
    draft_step2: float = 0.0
    wide: list = field(default_factory=list)

    @property
    def catch_up(self) -> float:
        """Extra cost of a two-token draft step over a one-token step."""
        return max(0.0, self.draft_step2 - self.draft_step)

    def verify_time(self, width: int) -> float:
        """Target forward time at `width` positions: between measured widths (`verify`, then
        `wide`) linear, past the widest the last measured slope extended."""
        if width <= len(self.verify):
            return self.verify[width - 1]
        points = [(len(self.verify), self.verify[-1])] + [(w, t) for w, t in self.wide if w > len(self.verify)]
        if len(points) == 1:
            slope = self.verify[-1] - self.verify[-2] if len(self.verify) > 1 else self.verify[-1]
            return self.verify[-1] + max(slope, 0.0) * (width - len(self.verify))
        for (w0, t0), (w1, t1) in zip(points, points[1:]):
            if width <= w1:
                break  # else: past the widest, the last segment's slope
        return t0 + max(t1 - t0, 0.0) / (w1 - w0) * (width - w0)

    def round_time(self, gamma: int, full_acceptance: float = 0.0) -> float:
        """One round: γ draft steps, then a target forward over γ + 1 positions; with
        probability `full_acceptance` the round before accepted everything and the first
        draft step feeds two tokens."""
        if gamma == 0:
            return self.verify_time(1)
        return gamma * self.draft_step + full_acceptance * self.catch_up + self.verify_time(gamma + 1)

    @property
    def c(self) -> float:
        """The paper's c: draft step time / target step time."""
        return self.draft_step / self.verify[0]


class LiveCosts:
    """A cost curve that learns while it runs: the calibration is a prior, and every round's
    measured time corrects the cost of its γ.

    The correction is a factor per γ: exp(median of the last `window` log(measured /
    calibrated) round times, with `prior_weight` rounds' worth of the prior), so one slow
    round (a page fault, another process) moves nothing, two agreeing rounds override a
    calibration made under load, and a machine that gets faster or slower is followed
    within a few rounds. A γ not yet measured borrows the nearest measured γ's factor, and
    that is its prior once measured: the whole curve follows what was learned.
    """

    def __init__(self, prior: CostCurve, window: int = 16, prior_weight: int = 1):
        self.prior = prior
        self.window, self.prior_weight = window, prior_weight
        self.residuals: dict[int, deque] = {}  # γ -> recent log(measured / calibrated)
        self._factors: dict[int, float] = {}

    def observe(self, gamma: int, seconds: float) -> None:
        """A round at `gamma` took `seconds` (draft, verify, sync and commit)."""
        expected = self.prior.round_time(gamma)
        if seconds > 0 and expected > 0:
            self.residuals.setdefault(gamma, deque(maxlen=self.window)).append(math.log(seconds / expected))
            self._factors.clear()

    def factor(self, gamma: int) -> float:
        """Measured / calibrated round time at γ (1 until a round was measured)."""
        if gamma not in self._factors:
            self._factors[gamma] = math.exp(self._log_factor(gamma))
        return self._factors[gamma]

    def _log_factor(self, gamma: int) -> float:
        # The prior for γ: the calibration as corrected by the nearest other measured γ
        # (or as measured, if none), worth `prior_weight` rounds.
        others = [g for g in self.residuals if g != gamma]
        anchor = 0.0
        if others:
            nearest = min(others, key=lambda g: (abs(g - gamma), g))
            anchor = statistics.median(list(self.residuals[nearest]) + [0.0] * self.prior_weight)
        own = self.residuals.get(gamma)
        return statistics.median(list(own) + [anchor] * self.prior_weight) if own else anchor

    def round_time(self, gamma: int, full_acceptance: float = 0.0) -> float:
        return self.prior.round_time(gamma, full_acceptance) * self.factor(gamma)

    @property
    def learned(self) -> dict[int, int]:
        """Rounds measured per γ."""
        return {g: len(r) for g, r in sorted(self.residuals.items())}


def weight_bytes(model) -> int:
    """Bytes of all parameters (what one forward pass reads)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def weight_bandwidth(stats, target_bytes: int, draft_bytes: int) -> float:
    """Achieved weight bandwidth in bytes/s during decode (`stats`: a `Stats`): weights read
    by every target and draft forward, over decode time (KV-cache reads not counted)."""
    if stats.decode_time <= 0:
        return 0.0
    read = target_bytes * stats.target_forwards + draft_bytes * stats.draft_forwards
    return read / stats.decode_time


def non_decreasing(times: list[float]) -> list[float]:
    """The closest non-decreasing curve (pool-adjacent-violators): a wider verify never
    costs less, so a dip is timing noise, and it must not steer the choice of γ."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in times:
        blocks.append([t, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]
