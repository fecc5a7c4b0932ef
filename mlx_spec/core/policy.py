"""Choosing γ, the number of draft tokens per round. γ = 0 is plain decoding.

`AutoGamma` picks, every round, the γ that maximises committed tokens per second:

    E(γ) = 1 + Σ_{j≤γ} Π_{i≤j} a_i          expected tokens per round
    T(γ) = γ · t_draft + t_verify(γ + 1)     measured round time (cost_model.CostCurve)

where a_i is the live conditional acceptance at draft position i (acceptance falls with
position, so one α does not fit). If no γ ≥ 1 beats plain decoding it parks at γ = 0 and
probes now and then, backing off while probes keep losing, so it can resume when the text
turns predictable.

Both inputs are learned while it runs. T(γ) starts from the calibration and follows every
round's measured time (`cost_model.LiveCosts`), so a calibration made under load cannot park
drafting for good. The acceptance evidence ages with every round, parked rounds faster (no
news comes while parked, and the text may have changed), so after a bad stretch of any
length two fully accepted probes bring drafting back.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import mlx.core as mx

from mlx_spec.core.cost_model import CostCurve, LiveCosts
from mlx_spec.core.tree import TreeShape
from mlx_spec.drafters.base import Draft

MAX_GAMMA = 16  # the largest γ anywhere; caches keep MAX_GAMMA + 1 positions of rollback slack


class GammaPolicy:
    """Chooses each round's γ and learns from its outcome. A policy that shapes draft trees
    sets `branches` (continuations asked of a drafter that can branch) and overrides
    `prune` and `observe_tree`; the others draw chains."""

    branches = 0  # 0: chains only

    def choose(self) -> int:
        """γ for the next round."""
        raise NotImplementedError

    def observe(self, gamma: int, accepted: int, seconds: Optional[float] = None) -> None:
        """The round drafted `gamma` tokens, the first `accepted` were accepted, and it
        took `seconds` (draft, verify, sync and commit; None where not measured)."""

    def prune(self, draft: Draft, max_nodes: Optional[int] = None) -> Draft:
        """The part of a drafted tree worth verifying, at most `max_nodes` nodes."""
        return draft

    def observe_tree(self, shape: TreeShape, path: list[int], seconds: Optional[float] = None) -> None:
        """A tree round: its shape, the accepted path's nodes, its time."""
        self.observe(shape.max_depth, len(path), seconds)


class FixedGamma(GammaPolicy):
    def __init__(self, gamma: int):
        if gamma < 0:
            raise ValueError("gamma must be >= 0")
        self.gamma = gamma

    def choose(self) -> int:
        return self.gamma

    def __repr__(self) -> str:
        return f"FixedGamma({self.gamma})"


def expected_tokens(acceptance: list[float], gamma: int) -> float:
    """E(γ) = 1 + Σ_{j≤γ} Π_{i≤j} a_i for conditional acceptances a_1, a_2, ..."""
    total, chain = 1.0, 1.0
    for a in acceptance[:gamma]:
        chain *= a
        total += chain
    return total


def full_acceptance(acceptance: list[float], gamma: int) -> float:
    """P(all γ draft tokens accepted) = Π_{i≤γ} a_i."""
    return math.prod(acceptance[:gamma])


def _padded(acceptance: Sequence[float], gamma: int) -> list[float]:
    """a_1..a_γ, the last one repeated past the end of the list."""
    acceptance = list(acceptance)
    if len(acceptance) < gamma:
        acceptance += [acceptance[-1] if acceptance else 0.0] * (gamma - len(acceptance))
    return acceptance


def tokens_per_second(costs: CostCurve, acceptance: Sequence[float], gamma: int) -> float:
    """The cost model: E(γ) / (γ·t_draft + t_verify(γ+1)), with conditional acceptances
    a_1..a_γ (the last one repeats past the end of the list)."""
    acceptance = _padded(acceptance, gamma)
    return expected_tokens(acceptance, gamma) / costs.round_time(gamma, full_acceptance(acceptance, gamma))


def cost_model_speedup(costs: CostCurve, acceptance: Sequence[float], gamma: float) -> float:
    """Expected speedup over plain decoding at γ from the measured cost curve and per-position
    acceptance. A fractional γ (auto's mean) interpolates between its neighbours."""
    if gamma <= 0:
        return 1.0
    lo, hi = math.floor(gamma), math.ceil(gamma)
    plain = tokens_per_second(costs, acceptance, 0)
    at_lo, at_hi = (tokens_per_second(costs, acceptance, g) / plain for g in (lo, hi))
    return at_lo + (gamma - lo) * (at_hi - at_lo)


def theorem_speedup(alpha: float, gamma: float, c: float) -> float:
    """Theorem 3.8 (Leviathan et al. 2023): expected walltime improvement
    (1 − α^(γ+1)) / ((1 − α)(γc + 1)), assuming independent acceptances and a verify pass
    over γ+1 positions that costs one target step. γ = 0 gives 1."""
    if gamma <= 0:
        return 1.0
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


class BatchShare:
    """What the requests decoding together chose last (`serve --parallel`): per policy, the
    rows its block adds to the batch's forward (γ + 1), its expected tokens E(γ) and its
    draft seconds. An `AutoGamma` given one chooses its γ for the batch's tokens per second
    (its `rate`), the others' latest choices held fixed; each request answering the others
    in turn climbs the same objective."""

    def __init__(self):
        self.choices: dict[int, tuple[int, float, float]] = {}  # id(policy) -> (rows, E, draft s)

    def others(self, policy) -> tuple[int, float, float]:
        """(rows, expected tokens, draft seconds) of every request but `policy`'s."""
        rest = [c for key, c in self.choices.items() if key != id(policy)]
        return sum(c[0] for c in rest), sum(c[1] for c in rest), sum(c[2] for c in rest)

    def record(self, policy, rows: int, tokens: float, draft_seconds: float) -> None:
        self.choices[id(policy)] = (rows, tokens, draft_seconds)

    def leave(self, policy) -> None:
        self.choices.pop(id(policy), None)


class AutoGamma(GammaPolicy):
    """Bandwidth-aware γ from a measured cost curve and live per-position acceptance.

    Args:
        costs: the measured `CostCurve` for this target/draft pair: the prior for round times.
        max_gamma: the largest γ considered.
        prior: acceptance assumed before evidence, per position; `prior_weight` rounds'
            worth of it, so a few rounds of evidence dominate.
        decay: weight kept by old evidence per round that drafted (recent text matters more).
        parked_decay: weight kept per round that drafted nothing: while parked the evidence
            is a bad stretch that may be over, so it fades within a probe interval.
        probe_every, max_probe_every: parked rounds between probes, doubling after each
            probe that is not fully accepted, reset by any fully accepted draft. Where even
            a perfect draft would not pay, it still probes every `max_probe_every` rounds (at
            most one probe's cost in that many rounds), so measured round times can
            overturn the curve.
        learn_costs: correct the cost curve with each round's measured time (`LiveCosts`);
            off, the curve is taken as given (tests with made-up curves).
        explore_every: while learning costs, every this many drafting rounds draft one
            token more than the best γ (where it is likely accepted), so widths the
            calibration priced too high get measured.
        batch: the `BatchShare` of the requests this one decodes beside; then γ maximises
            the batch's tokens per second, with the verify cost at the batch's total rows
            (the curve's last measured slope extended past its widths):
                (E(γ) + E_others) / (γ·t_draft + D_others + t_verify(R_others + γ + 1))
            where R_others, E_others and D_others are the other requests' rows, expected
            tokens and draft seconds as they last chose. Alone (or None) it is the
            single-request rate.
    """

    def __init__(
        self,
        costs: CostCurve,
        max_gamma: int = 6,
        prior: float = 0.9,
        prior_weight: float = 1.0,
        decay: float = 0.97,
        parked_decay: float = 0.8,
        probe_every: int = 8,
        max_probe_every: int = 128,
        learn_costs: bool = True,
        explore_every: int = 8,
        batch: Optional[BatchShare] = None,
    ):
        self.calibrated = costs  # the curve as measured, whatever LiveCosts learns
        self.costs = LiveCosts(costs) if learn_costs else costs
        self.batch = batch
        self.max_gamma = max_gamma
        self.prior, self.prior_weight = prior, prior_weight
        self.decay, self.parked_decay = decay, parked_decay
        self.reached = [0.0] * max_gamma  # decayed: rounds that drafted position i with i-1 accepted
        self.taken = [0.0] * max_gamma  # decayed: of those, rounds that accepted position i
        self.base_probe_every = self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.explore_every, self.drafting_rounds = explore_every, 0
        self.parked = False  # no γ ≥ 1 paid: plain rounds until a probe says otherwise
        self.parked_for = 0
        self.probing = False
        self.last_choice = 0

    @property
    def can_pay(self) -> bool:
        """Whether a draft that is always right would beat plain decoding on these costs."""
        return self._best([1.0] * self.max_gamma) > 0

    def acceptance(self) -> list[float]:
        """Smoothed conditional acceptance a_1..a_γmax. Each position's prior is the
        estimate of the position before it: acceptance rarely rises with position, and an
        unseen position is worth one probe when its predecessor does well."""
        rates, prior = [], self.prior
        for taken, reached in zip(self.taken, self.reached):
            prior = (taken + self.prior_weight * prior) / (reached + self.prior_weight)
            rates.append(prior)
        return rates

    def rate(self, gamma: int, acceptance: list[float] | None = None) -> float:
        """Expected tokens per second at γ: of this request alone, or of the batch (`batch`)."""
        acceptance = self.acceptance() if acceptance is None else acceptance
        rows, tokens, drafting = self.batch.others(self) if self.batch is not None else (0, 0.0, 0.0)
        if not rows:
            return tokens_per_second(self.costs, acceptance, gamma)
        # the calibrated curve: a batched round's measured time is the batch's, not this
        # request's, so it teaches LiveCosts nothing (`observe`)
        curve = self.calibrated
        acceptance = _padded(acceptance, gamma)
        seconds = (gamma * curve.draft_step + full_acceptance(acceptance, gamma) * curve.catch_up + drafting
                   + curve.verify_time(rows + gamma + 1))
        return (expected_tokens(acceptance, gamma) + tokens) / seconds

    def predicted_speedup(self, gamma: int) -> float:
        """Expected speedup over plain decoding at γ (Theorem 3.8 with measured costs and
        per-position acceptance)."""
        return cost_model_speedup(self.costs, self.acceptance(), gamma)

    def best(self, min_gamma: int = 0) -> int:
        return self._best(self.acceptance(), min_gamma)

    def _best(self, acceptance: list[float], min_gamma: int = 0) -> int:
        return max(range(min_gamma, self.max_gamma + 1), key=lambda g: self.rate(g, acceptance))

    def choose(self) -> int:
        # Parked, only a probe's outcome can bring drafting back: evidence fading while
        # parked must not by itself flip the choice (drafting, losing, parking, in a cycle).
        can_pay = self.can_pay
        batched = self._batched()
        if not self.parked:
            gamma = self.best() if can_pay else 0
            # In a batch, γ = 0 may be the batch's choice (the others' rows make this one's
            # dear) while drafting still pays for the request alone: that is no evidence
            # against drafting, so it does not park; the next round chooses afresh.
            self.parked = gamma == 0 and not (batched and self._best_alone() > 0)
            self.drafting_rounds += gamma > 0
            # Now and then one position more than the best, where it may well be accepted:
            # its measured time corrects a calibration that priced it too dear (not in a
            # batch, whose round times teach nothing: `observe`).
            if (isinstance(self.costs, LiveCosts) and not batched and 0 < gamma < self.max_gamma
                    and self.drafting_rounds % self.explore_every == 0 and self.acceptance()[gamma] >= 0.5):
                gamma += 1
        if self.parked:
            gamma = 0
            self.parked_for += 1
            if self.parked_for >= (self.probe_every if can_pay else self.max_probe_every):
                self.parked_for, self.probing = 0, True
                gamma = self.best(min_gamma=1)
        self.last_choice = gamma
        if self.batch is not None:
            acceptance = self.acceptance()
            draft_seconds = gamma * self.calibrated.draft_step
            self.batch.record(self, gamma + 1, expected_tokens(acceptance, gamma), draft_seconds)
        return gamma

    def _batched(self) -> bool:
        """Whether other requests decode beside this one."""
        return self.batch is not None and self.batch.others(self)[0] > 0

    def _best_alone(self) -> int:
        """The γ this request would choose decoding alone."""
        acceptance = self.acceptance()
        return max(range(self.max_gamma + 1), key=lambda g: tokens_per_second(self.costs, acceptance, g))

    def observe(self, gamma: int, accepted: int, seconds: Optional[float] = None) -> None:
        if seconds is not None and isinstance(self.costs, LiveCosts) and not self._batched():
            self.costs.observe(gamma, seconds)
        keep = self.decay if gamma else self.parked_decay
        self.reached = [keep * r for r in self.reached]
        self.taken = [keep * t for t in self.taken]
        for i in range(min(accepted + 1, gamma)):  # positions this round reached
            self.reached[i] += 1
            self.taken[i] += i < accepted
        # A fully accepted draft means drafting pays again: probe soon after the next
        # parking. A probe that lost backs off. (A probe round is never pipelined, so it
        # is observed before the next choice.)
        full = gamma > 0 and accepted == gamma
        if full:
            self.probe_every = self.base_probe_every
        if gamma and self.probing:  # only a probe that was fully accepted may unpark
            self.probing = False
            if not full:
                self.probe_every = min(2 * self.probe_every, self.max_probe_every)
            self.parked = not (full and self.can_pay and self.best() > 0)

    def __repr__(self) -> str:
        return f"AutoGamma(max_gamma={self.max_gamma})"


class TreePolicy(AutoGamma):
    """Draft trees shaped by the cost curve: auto γ chooses the depth, the drafter proposes
    its widest tree that deep (`branches` continuations), and `prune` keeps the nodes that
    maximise expected committed tokens per second (Sequoia's aim; EAGLE-2's greedy cut):

        v(node) = v(parent) · Π_{j<k} (1 − a(d, j)) · a(d, k)   P(the round accepts it)
        keep the m likeliest nodes, m maximising (1 + Σ v) / T(m)

    where a(d, k) is the live conditional acceptance of a node at depth d and sibling rank
    k (its parent accepted, its k earlier siblings rejected) and T(m) the round time with m
    nodes (a verify over m + 1 rows; `LiveCosts` follows measured tree rounds). Likelier
    nodes never sit below less likely ones (v falls along a path), so the kept nodes form a
    tree. Where width is dear the cut keeps the chain, or nothing (a plain round). While
    it learns costs, the first cut that drafts and every `explore_every`-th after it also
    keep the likeliest sibling left out (and its path), so a(d, k) for k > 0 is measured,
    not only assumed.

    Args:
        costs, max_gamma and the rest: as `AutoGamma` (max_gamma: the deepest tree).
        branches: continuations the drafter is asked for.
        max_nodes: the most nodes a tree may keep (the caches' rollback slack bounds it).
    """

    def __init__(self, costs: CostCurve, max_gamma: int = 6, branches: int = 4, max_nodes: int = MAX_GAMMA,
                 **kwargs):
        super().__init__(costs, max_gamma=max_gamma, **kwargs)
        self.branches, self.max_nodes = branches, max_nodes
        self.rank_tried: dict[tuple[int, int], float] = {}  # decayed: (depth, rank) -> turns that came
        self.rank_taken: dict[tuple[int, int], float] = {}  # decayed: of those, accepted
        # the cost model's forecast for the rounds so far, on the calibrated curve: expected
        # tokens and seconds, summed (`forecast_speedup`)
        self.forecast_tokens = self.forecast_seconds = 0.0
        self.cuts = 0  # cuts that kept nodes, for exploration

    @property
    def forecast_speedup(self) -> float:
        """Forecast tokens per second over the rounds so far / plain decoding's."""
        if not self.forecast_seconds:
            return 1.0
        return self.forecast_tokens / self.forecast_seconds * self.calibrated.round_time(0)

    def rank_acceptance(self, depth: int, rank: int) -> float:
        """a(d, k), smoothed: rank 0's prior is auto γ's acceptance at depth d, rank k's
        half of rank k−1's (later siblings are the less likely continuations)."""
        rates = self.acceptance()
        prior = rates[min(depth, len(rates)) - 1] if rank == 0 else 0.5 * self.rank_acceptance(depth, rank - 1)
        tried = self.rank_tried.get((depth, rank), 0.0)
        return (self.rank_taken.get((depth, rank), 0.0) + self.prior_weight * prior) / (tried + self.prior_weight)

    def node_values(self, shape: TreeShape) -> list[float]:
        """v(node) for every node of `shape`."""
        values: list[float] = []
        for parent, depth, rank in zip(shape.parents, shape.depth, shape.rank):
            v = 1.0 if parent < 0 else values[parent]
            for j in range(rank):
                v *= 1.0 - self.rank_acceptance(depth, j)
            values.append(v * self.rank_acceptance(depth, rank))
        return values

    def prune(self, draft, max_nodes: Optional[int] = None):
        """The part of `draft`'s tree worth verifying, at most `max_nodes` nodes (a chain is
        returned as a chain)."""
        if draft.tree is None:
            return draft
        values = self.node_values(draft.tree)
        limit = min(self.max_nodes, max_nodes or self.max_nodes)
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))[:limit]
        expected, best, best_rate = 1.0, 0, 1.0 / self.costs.round_time(0)
        for m, i in enumerate(order, start=1):
            expected += values[i]
            rate = expected / tree_round_time(self.costs, m, draft.forwards)
            if rate > best_rate:
                best, best_rate = m, rate
        keep = set(order[:best])
        if keep:  # a plain round is forecast where it is observed
            self.forecast_tokens += 1.0 + sum(values[i] for i in keep)
            self.forecast_seconds += tree_round_time(self.calibrated, best, draft.forwards)
            self.cuts += 1
            if isinstance(self.costs, LiveCosts) and self.cuts % self.explore_every == 1:
                left_out = [i for i in order if i not in keep and draft.tree.rank[i] > 0]
                if left_out:
                    keep |= set(draft.tree.path(left_out[0]))
        keep = sorted(keep)[:limit]  # nodes come after their parents: a cut stays a tree
        shape = draft.tree.subtree(keep)
        index = mx.array(keep) if keep else None
        tokens = draft.tokens[index] if keep else draft.tokens[:0]
        q = None if draft.q is None or not keep else draft.q[index]
        return Draft(tokens, q, tree=None if shape == TreeShape.chain(len(keep)) else shape, forwards=draft.forwards)

    def observe(self, gamma: int, accepted: int, seconds: Optional[float] = None) -> None:
        if gamma == 0:
            self.forecast_tokens += 1.0
            self.forecast_seconds += self.calibrated.round_time(0)
        super().observe(gamma, accepted, seconds)

    def observe_tree(self, shape: TreeShape, path: list[int], seconds: Optional[float] = None) -> None:
        """A tree round: its m nodes cost what a width-(m + 1) round does, its accepted path
        teaches auto γ the acceptance by depth, its tried nodes a(d, k)."""
        AutoGamma.observe(self, shape.max_depth, len(path), None)
        if seconds is not None and isinstance(self.costs, LiveCosts):
            self.costs.observe(shape.size, seconds)
        self.rank_tried = {k: self.decay * v for k, v in self.rank_tried.items()}
        self.rank_taken = {k: self.decay * v for k, v in self.rank_taken.items()}
        for depth, rank, ok in shape.attempts(path):
            self.rank_tried[depth, rank] = self.rank_tried.get((depth, rank), 0.0) + 1
            self.rank_taken[depth, rank] = self.rank_taken.get((depth, rank), 0.0) + ok

    def __repr__(self) -> str:
        return f"TreePolicy(max_gamma={self.max_gamma}, branches={self.branches})"


def tree_round_time(costs, nodes: int, forwards: Optional[int]) -> float:
    """A round verifying `nodes` tree nodes after `forwards` draft forwards (None: one per
    node, as a chain's): the draft steps are what the drafter spent, not one per node."""
    time = costs.round_time(nodes)
    if forwards is None or nodes == 0:
        return time
    draft_step = getattr(costs, "prior", costs).draft_step
    return time + (forwards - nodes) * draft_step


def as_policy(gamma: "int | GammaPolicy") -> GammaPolicy:
    return FixedGamma(gamma) if isinstance(gamma, int) else gamma
