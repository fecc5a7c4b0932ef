"""The γ sweep behind `mlx-spec bench`, as a library so `bench/` scripts reuse it.

The procedure a careful user follows by hand, automated:
  1. baseline: the target alone (drafting off, γ = 0) on the same prompt
  2. each γ in a list (and `auto` if asked), same prompt, same sampling
  3. one cold run per setting reported apart, then N warm runs, interleaved across settings
     (rep 1 runs every setting, then rep 2, ...) so slow drift hits all settings alike
  4. medians of warm runs; speedup = median decode tok/s / the baseline's
  5. at temperature 0, md5 of the generated token ids must equal the baseline's: exactness;
     where they differ, the target's top-2 logit gap there tells a numerical near-tie (a GPU's
     multi-row and one-row kernels round differently, as MKL's do on 4+ rows) from a real
     mismatch; the baseline's near-ties are counted, as the places a difference may come
  6. the Theorem 3.8 prediction, speedup = (1 − α^(γ+1)) / ((1 − α)(γc + 1)), from measured
     α̂ and c, next to the measured speedup; and the cost-model prediction that uses the
     measured verify curve and per-position acceptance instead of c and one α
  7. recommend the fastest exact setting (γ = 0 when nothing pays)

A `tree` setting (`bench --tree`) runs draft trees shaped by `TreePolicy`; its cost-model
prediction is the policy's own forecast over the rounds it ran (expected tokens of each
tree it kept over that tree's calibrated verify time), and its mean γ is nodes per round.

The engine knows no text: prompts are token ids here, tokenized by the caller.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx

from mlx_spec.apps.calibration import load_or_measure
from mlx_spec.apps.distributed import CommProfile, comm_profile, world
from mlx_spec.apps.runner import (
    MAX_AUTO_GAMMA,
    TREE,
    TREE_NODES,
    Gamma,
    build_engine,
    context_bucket,
    gamma_policy,
)
from mlx_spec.core.cost_model import CostCurve, weight_bandwidth, weight_bytes
from mlx_spec.core.engine import Engine
from mlx_spec.core.policy import FixedGamma, cost_model_speedup, theorem_speedup
from mlx_spec.core.sampling import LogitProcessor, SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.broadcast import BroadcastDrafter
from mlx_spec.errors import MlxSpecError

BASELINE = "off"  # label of the drafting-off setting
DEFAULT_GAMMAS = tuple(Gamma(g) for g in (1, 2, 3, 5))

# A multi-row verify pass and a one-row decode step run different kernels on a GPU, so at
# a near-tie their argmax can differ while both are right to rounding. A first difference
# where the target's top-2 logits are closer than this (relative to the top logit) is a
# numerical near-tie, reported apart from a mismatch. About four units in the last place.
NEAR_TIE = {mx.float32: 1e-4, mx.bfloat16: 2**-6, mx.float16: 2**-9}


# ---------------------------------------------------------------------------------------
# Identity
# ---------------------------------------------------------------------------------------


def token_md5(tokens: Sequence[int]) -> str:
    """md5 of the generated token ids (comma-separated decimal), the identity fingerprint."""
    return hashlib.md5(",".join(map(str, tokens)).encode()).hexdigest()


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first token where `a` and `b` differ (or where one ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_gaps(model, ids: Sequence[int], start: int, params: SamplingParams,
               chunk: int = 64) -> list[tuple[float, float]]:
    """(gap, tolerance) after each prefix ids[:p], p = start..len(ids): the target's top-1 −
    top-2 logit there (penalized as the engine's greedy choice is), and the `NEAR_TIE`
    tolerance for its dtype at that size. One cached pass over `ids`, `chunk` rows at a
    time (plain mlx-lm caches; a chunk's logits are chunk × V floats)."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = list(ids)
    if not 1 <= start <= len(ids):
        raise ValueError("start must be within 1..len(ids)")
    cache, processor, gaps = make_prompt_cache(model), LogitProcessor(params), []
    for first in range(0, start - 1, chunk):  # the context before the first prefix scored
        model(mx.array(ids[first:min(first + chunk, start - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    for first in range(start - 1, len(ids), chunk):
        block = ids[first:first + chunk]  # row r scores what follows ids[:first + r + 1]
        logits = model(mx.array(block)[None], cache=cache)[0]
        windows = processor.windows(ids[:first + 1], mx.array(block[1:] or [0]), len(block))
        top = mx.topk(processor.penalize(logits, windows).astype(mx.float32), 2, axis=-1)
        tolerance = NEAR_TIE.get(logits.dtype, 1e-4)
        for pair in top.tolist():
            high, low = max(pair), min(pair)
            gaps.append((high - low, tolerance * max(1.0, abs(high))))
    return gaps


def logit_gap(model, ids: Sequence[int], params: SamplingParams) -> tuple[float, float]:
    """(gap, tolerance) after all of `ids` (see `logit_gaps`)."""
    return logit_gaps(model, ids, len(ids), params)[-1]


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """One generation: a setting on a prompt, cold (first) or warm."""

    prompt: str
    setting: str  # "off", "γ=3", "auto"
    gamma: Union[int, str]  # as --json shows it (`Gamma.value`): 0 for the baseline, 3, "auto"
    rep: int  # 0 = cold
    tokens: list[int] = field(repr=False)
    stats: Stats = field(repr=False)
    md5: str = ""
    bandwidth: float = 0.0  # bytes/s
    mismatch_at: Optional[int] = None  # first token differing from the baseline (T = 0)
    near_tie: bool = False  # ... where the target's top-2 logits tie to rounding
    forecast: Optional[float] = None  # the tree policy's predicted speedup for this run

    @property
    def cold(self) -> bool:
        return self.rep == 0


@dataclass
class SettingSummary:
    """Warm-run medians and aggregates of one setting on one prompt."""

    prompt: str
    setting: str
    gamma: Union[int, str]  # as `Run.gamma`
    runs: int
    decode_tps: float  # median over warm runs
    tps_min: float
    tps_max: float
    spread: float  # (max − min) / median
    speedup: float  # vs the baseline's median
    cold_tps: float
    cold_prefill_time: float
    acceptance_rate: float  # α̂ over warm runs
    acceptance_by_position: list[float]  # by depth for a tree
    conditional_acceptance: list[float]
    mean_accepted_length: float
    mean_gamma: float  # drafted / rounds (auto varies γ)
    prefill_time: float  # median, seconds
    prefill_share: float  # prefill / (prefill + decode), median
    predicted_speedup: Optional[float]  # Theorem 3.8 with α = accepted / reached positions, c and
    # mean γ (None for trees, which it does not describe)
    cost_model_speedup: float  # measured verify curve and per-position acceptance
    bandwidth: float  # bytes/s, median
    peak_memory: int
    generated: int  # tokens per run (median)
    md5: str  # of the cold run's tokens
    identical: Optional[bool]  # all runs equal the baseline (None above T = 0)
    mismatch_at: Optional[int]  # first differing token index of the first mismatching run
    near_tie: bool = False  # every run that differs first differs at a numerical near-tie
    # Across ranks (tensor parallel) only: all-reduces per round (counted) and their time
    # (count × measured latency at the round's width), and its share of the round.
    all_reduces_per_round: Optional[float] = None
    comm_time_per_round: Optional[float] = None
    comm_share: Optional[float] = None
    single_speedup: Optional[float] = None  # the same setting's speedup on one machine (bench --compare)
    acceptance_by_rank: list[float] = field(default_factory=list)  # draft trees: by sibling rank


@dataclass
class Mismatch:
    """A run whose tokens differ from the baseline's, and how close the target's choice was
    where they first differ (its top-2 logit gap on the baseline's context)."""

    prompt: str
    setting: str
    rep: int
    index: int
    gap: float
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "near_tie": self.near_tie}

    def __str__(self) -> str:
        kind = "cold run" if self.rep == 0 else f"warm run {self.rep}"
        closeness = (f"a numerical near-tie: the target's top-2 logits there are {self.gap:.3g} apart, "
                     f"within the tolerance {self.tolerance:.3g}" if self.near_tie else
                     f"the target's top-2 logits there are {self.gap:.3g} apart, past the "
                     f"near-tie tolerance {self.tolerance:.3g}")
        return (f"output differs from the baseline: prompt {self.prompt!r}, setting {self.setting}, "
                f"{kind}, first differing token index {self.index}; {closeness}")


@dataclass
class SweepResult:
    summaries: list[SettingSummary]
    runs: list[Run] = field(repr=False)
    mismatches: list[Mismatch]
    recommendation: str  # a setting label
    recommended_speedup: float
    costs: CostCurve
    params: SamplingParams
    prompts: dict[str, int]  # name → prompt tokens
    drafter: str
    max_tokens: int
    warm_runs: int
    comm: Optional[CommProfile] = None  # across ranks: the target's all-reduces
    # T = 0: per prompt, the baseline tokens chosen where the target's top-2 logits tie to
    # rounding (`NEAR_TIE`): the only places an exact setting may legitimately differ
    baseline_near_ties: dict[str, list[int]] = field(default_factory=dict)

    @property
    def identity_checked(self) -> bool:
        return self.params.greedy

    @property
    def failures(self) -> list[Mismatch]:
        """Real mismatches: exactness failures."""
        return [m for m in self.mismatches if not m.near_tie]

    @property
    def near_ties(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.near_tie]

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        """JSON-ready: settings, mismatches, recommendation, cost curve, configuration."""
        return {
            "drafter": self.drafter,
            "sampling": asdict(self.params),
            "max_tokens": self.max_tokens,
            "warm_runs": self.warm_runs,
            "prompts": self.prompts,
            "identity_checked": self.identity_checked,
            "ok": self.ok,
            "mismatches": [m.as_dict() for m in self.mismatches],
            "baseline_near_ties": self.baseline_near_ties,
            "recommendation": {"setting": self.recommendation, "speedup": self.recommended_speedup},
            "costs": {**asdict(self.costs), "c": self.costs.c},
            "tensor_parallel": asdict(self.comm) if self.comm else None,
            "settings": [asdict(s) for s in self.summaries],
        }


# ---------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------


def setting_label(gamma: Gamma) -> str:
    return BASELINE if gamma == 0 else (str(gamma) if gamma.fixed is None else f"γ={gamma}")


def run_sweep(
    pair,
    prompts: dict[str, list[int]],
    *,
    drafter: Optional[str] = None,
    gammas: Sequence[Gamma] = DEFAULT_GAMMAS,
    warm_runs: int = 3,
    max_tokens: int = 128,
    params: SamplingParams = SamplingParams(),
    progress: Optional[Callable[[int, int, str], None]] = None,
    calibration_progress: Optional[Callable[[int, int], None]] = None,
    engine_options: Optional[dict] = None,
) -> SweepResult:
    """Sweep γ against a drafting-off baseline.

    Args:
        pair: a loaded `ModelPair` (target, optional draft, tokenizer, vocab widths).
        prompts: name → prompt token ids.
        drafter: "model", "mtp", "suffix", "ngram" or None (as `build_engine` chooses); a
            drafter that remembers earlier requests (suffix) drafts without that memory here.
        gammas: the γ values (`Gamma`s: numbers and/or "auto", "tree") to compare with the
            baseline.
        warm_runs: timed runs per setting after the cold one.
        max_tokens: tokens generated per run.
        params: sampling; at temperature 0 every run's tokens must equal the baseline's.
        progress: called with (runs done, runs total, description) after each run.
        calibration_progress: called with (done, total) while the cost curve is measured.
        engine_options: more `build_engine` keywords for both engines (K/V quantization).
    Returns:
        A `SweepResult`; `.ok` is False when an output differed from the baseline.
    """
    if not prompts:
        raise MlxSpecError("no prompts to benchmark")
    if warm_runs < 1:
        raise MlxSpecError("--runs must be at least 1")
    plain = build_engine(pair, "none", **(engine_options or {}))
    spec = build_engine(pair, drafter, **(engine_options or {}))
    if spec.drafter is None:
        raise MlxSpecError("the sweep needs a drafter: --drafter model, mtp, suffix or ngram")
    if spec.drafter.remembers:  # runs of one prompt must not draft from each other's answers
        spec = spec.for_request(memory=None)
    drafter_name = spec.drafter.name
    draft_model = None if spec.drafter is None else spec.drafter.model
    target_bytes = weight_bytes(spec.target)
    draft_bytes = weight_bytes(draft_model) if draft_model is not None else 0

    # The cost curve gives c for Theorem 3.8 and the cost-model prediction; measured once
    # per pair/machine/context bucket and cached (the same entry --gamma auto reads).
    longest = max(len(ids) for ids in prompts.values())
    numeric = [g.fixed for g in gammas if g.fixed is not None]
    width = max([MAX_AUTO_GAMMA] + numeric + ([TREE_NODES] if any(g.tree for g in gammas) else [])) + 1
    costs = load_or_measure(spec.target, draft_model, max_width=width,
                            context=context_bucket(longest), progress=calibration_progress)
    w = world()
    comm = comm_profile(w, spec.target, width) if w.active else None
    broadcasts = isinstance(spec.drafter, BroadcastDrafter)  # one more collective per drafted round

    settings: list[Gamma] = [Gamma.OFF] + list(gammas)
    total = len(prompts) * len(settings) * (warm_runs + 1)
    runs: list[Run] = []
    done = 0
    for rep in range(warm_runs + 1):  # rep 0 is the cold pass over every setting
        for name, ids in prompts.items():
            for gamma in settings:
                label = setting_label(gamma)
                if progress:
                    progress(done, total, f"{name} {label} {'cold' if rep == 0 else f'run {rep}'}")
                engine = plain if gamma == 0 else spec
                policy = (gamma_policy(gamma, spec, context=len(ids), progress=calibration_progress)
                          if gamma.fixed is None else FixedGamma(gamma.fixed))
                runs.append(_one_run(engine, ids, params, policy, max_tokens, name, label, gamma.value, rep,
                                     target_bytes, draft_bytes))
                done += 1
    if progress:
        progress(done, total, "done")

    mismatches, near_ties = _check_identity(runs, spec.target, prompts, params) if params.greedy else ([], {})
    summaries = [
        _summarize([r for r in runs if r.prompt == name and r.setting == setting_label(g)], costs, params)
        for name in prompts for g in settings
    ]
    if comm is not None:
        for summary, g in zip(summaries, settings * len(prompts)):
            _fill_comm(summary, [r for r in runs if r.prompt == summary.prompt and r.setting == summary.setting
                                 and not r.cold], comm, broadcasts and g != 0)
    _fill_speedups(summaries)
    recommendation, speedup = recommend(summaries)
    return SweepResult(summaries, runs, mismatches, recommendation, speedup, costs, params,
                       {k: len(v) for k, v in prompts.items()}, drafter_name, max_tokens, warm_runs, comm,
                       near_ties)


def _fill_comm(summary: SettingSummary, warm: list[Run], comm: CommProfile, broadcasts: bool) -> None:
    """All-reduces per round: the verify forward's, the verdict's broadcast, and the draft's
    in rounds that drafted (rank 0's draft model); their time at the mean verify width."""
    rounds = sum(r.stats.rounds for r in warm) or 1
    drafting = sum(r.stats.drafted_at[0] if r.stats.drafted_at else 0 for r in warm) / rounds
    extra = 1.0 + (drafting if broadcasts else 0.0)
    summary.all_reduces_per_round = comm.per_forward + extra
    summary.comm_time_per_round = comm.per_round(1 + summary.mean_gamma) + extra * comm.broadcast
    round_time = sum(r.stats.decode_time for r in warm) / rounds
    summary.comm_share = summary.comm_time_per_round / round_time if round_time else 0.0


def _one_run(engine: Engine, ids, params, policy, max_tokens, prompt, label, gamma, rep,
             target_bytes, draft_bytes) -> Run:
    stats = Stats()
    mx.reset_peak_memory()
    tokens: list[int] = []
    for rnd in engine.rounds(ids, params, gamma=policy, max_tokens=max_tokens, stats=stats):
        tokens += rnd.tokens
    bandwidth = weight_bandwidth(stats, target_bytes, draft_bytes if engine.drafter else 0)
    return Run(prompt, label, gamma, rep, tokens, stats, token_md5(tokens), bandwidth,
               forecast=getattr(policy, "forecast_speedup", None))


def _check_identity(runs: list[Run], target, prompts: dict[str, list[int]],
                    params) -> tuple[list[Mismatch], dict[str, list[int]]]:
    """Every run's tokens against the baseline's cold run on the same prompt; where they
    first differ, how close the target's top-2 logits are on the baseline's context.
    Also, per prompt, the positions of the baseline's tokens chosen at a numerical
    near-tie: where any setting could differ while both are right to rounding."""
    reference = {r.prompt: r for r in runs if r.setting == BASELINE and r.cold}
    gaps = {name: logit_gaps(target, prompts[name] + ref.tokens, len(prompts[name]), params)
            for name, ref in reference.items()}
    mismatches = []
    for r in runs:
        ref = reference[r.prompt]
        if r is ref or r.md5 == ref.md5:
            continue
        r.mismatch_at = first_difference(r.tokens, ref.tokens)
        if r.mismatch_at is None:
            continue
        mismatch = Mismatch(r.prompt, r.setting, r.rep, r.mismatch_at, *gaps[r.prompt][r.mismatch_at])
        r.near_tie = mismatch.near_tie
        mismatches.append(mismatch)
    near_ties = {name: [i for i, (gap, tolerance) in enumerate(g[:len(reference[name].tokens)]) if gap <= tolerance]
                 for name, g in gaps.items()}
    return mismatches, near_ties


def _summarize(runs: list[Run], costs: CostCurve, params: SamplingParams) -> SettingSummary:
    cold = next(r for r in runs if r.cold)
    warm = [r for r in runs if not r.cold] or [cold]
    tps = [r.stats.decode_tps for r in warm]
    med = statistics.median(tps)
    drafted = sum(r.stats.drafted for r in warm)
    accepted = sum(r.stats.accepted for r in warm)
    rounds = sum(r.stats.rounds for r in warm)
    alpha = accepted / drafted if drafted else 0.0  # α̂, the reported metric
    # Theorem 3.8's α is the chance that a reached position is accepted: accepted/drafted
    # would count positions after a rejection, never reached, as rejections (it gives 0.59
    # for α = 0.8 at γ = 4).
    reached = sum(sum(r.stats.reached_at) for r in warm)
    alpha_reached = accepted / reached if reached else 0.0
    width = max((len(r.stats.drafted_at) for r in warm), default=0)

    def pooled(num: str, den: str) -> list[float]:
        out = []
        for i in range(width):
            n = sum(getattr(r.stats, num)[i] for r in warm if i < len(getattr(r.stats, num)))
            d = sum(getattr(r.stats, den)[i] for r in warm if i < len(getattr(r.stats, den)))
            out.append(n / d if d else 0.0)
        return out

    by_position = pooled("accepted_at", "drafted_at")
    conditional = pooled("accepted_at", "reached_at")
    mean_gamma = drafted / rounds if rounds else 0.0
    prefill = [r.stats.prefill_time for r in warm]
    share = [r.stats.prefill_time / (r.stats.prefill_time + r.stats.decode_time)
             if r.stats.prefill_time + r.stats.decode_time > 0 else 0.0 for r in warm]
    mismatched = [r for r in runs if r.mismatch_at is not None]
    tree = cold.gamma == TREE
    tried = [sum(r.stats.tried_at_rank[k] for r in warm if k < len(r.stats.tried_at_rank))
             for k in range(max(len(r.stats.tried_at_rank) for r in warm))]
    taken = [sum(r.stats.accepted_at_rank[k] for r in warm if k < len(r.stats.accepted_at_rank))
             for k in range(len(tried))]
    return SettingSummary(
        prompt=cold.prompt,
        setting=cold.setting,
        gamma=cold.gamma,
        runs=len(warm),
        decode_tps=med,
        tps_min=min(tps),
        tps_max=max(tps),
        spread=(max(tps) - min(tps)) / med if med else 0.0,
        speedup=1.0,
        cold_tps=cold.stats.decode_tps,
        cold_prefill_time=cold.stats.prefill_time,
        acceptance_rate=alpha,
        acceptance_by_position=by_position,
        conditional_acceptance=conditional,
        mean_accepted_length=1 + accepted / rounds if rounds else 0.0,
        mean_gamma=mean_gamma,
        prefill_time=statistics.median(prefill),
        prefill_share=statistics.median(share),
        predicted_speedup=None if tree else theorem_speedup(alpha_reached, mean_gamma, costs.c),
        cost_model_speedup=(statistics.median(r.forecast for r in warm) if tree
                            else cost_model_speedup(costs, conditional, mean_gamma)),
        bandwidth=statistics.median(r.bandwidth for r in warm),
        peak_memory=max(r.stats.peak_memory for r in runs),
        generated=int(statistics.median(r.stats.generated for r in warm)),
        md5=cold.md5,
        identical=None if not params.greedy else not mismatched,
        mismatch_at=mismatched[0].mismatch_at if mismatched else None,
        near_tie=bool(mismatched) and all(r.near_tie for r in mismatched),
        acceptance_by_rank=[a / t if t else 0.0 for a, t in zip(taken, tried)],
    )


def _fill_speedups(summaries: list[SettingSummary]) -> None:
    base = {s.prompt: s.decode_tps for s in summaries if s.setting == BASELINE}
    for s in summaries:
        s.speedup = s.decode_tps / base[s.prompt] if base[s.prompt] else 0.0


def recommend(summaries: list[SettingSummary]) -> tuple[str, float]:
    """The setting with the highest geometric-mean speedup over prompts among those whose
    output matched the baseline (or was not checked, or differed only at a numerical
    near-tie); the baseline when nothing beats it."""
    by_setting: dict[str, list[float]] = {}
    excluded = {s.setting for s in summaries if s.identical is False and not s.near_tie}
    for s in summaries:
        if s.setting not in excluded:
            by_setting.setdefault(s.setting, []).append(max(s.speedup, 1e-9))
    means = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in by_setting.items()}
    best = max(means, key=lambda k: (means[k], k == BASELINE))
    return best, means[best]
