"""The γ sweep behind `mlx-spec bench`, as a library so `bench/` scripts reuse it.

The procedure a careful user follows by hand, automated:
  1. baseline: the target alone (drafting off, γ = 0) on the same prompt
  2. each γ in a list (and `auto` if asked), same prompt, same sampling
  3. one cold run per setting reported apart, then N warm runs, interleaved across settings
     (rep 1 runs every setting, then rep 2, ...) so slow drift hits all settings alike
  4. medians of warm runs; speedup = median decode tok/s / the baseline's
  5. at temperature 0, md5 of the generated token ids must equal the baseline's: exactness
  6. the Theorem 3.8 prediction, speedup = (1 − α^(γ+1)) / ((1 − α)(γc + 1)), from measured
     α̂ and c, next to the measured speedup; and the cost-model prediction that uses the
     measured verify curve and per-position acceptance instead of c and one α
  7. recommend the fastest exact setting (γ = 0 when nothing pays)

The engine knows no text: prompts are token ids here, tokenized by the caller.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx

from mlx_spec.costs import CostCurve, load_or_measure, weight_bytes
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.policy import FixedGamma, expected_tokens, full_acceptance
from mlx_spec.runner import MAX_AUTO_GAMMA, build_engine, context_bucket, gamma_policy
from mlx_spec.sampling import SamplingParams
from mlx_spec.stats import Stats

PROMPT_DIR = Path(__file__).parent / "prompts"
BASELINE = "off"  # label of the drafting-off setting
DEFAULT_GAMMAS = (1, 2, 3, 5)

Gamma = Union[int, str]  # a whole number, or "auto"


# ---------------------------------------------------------------------------------------
# Formulas and checks
# ---------------------------------------------------------------------------------------


def theorem_speedup(alpha: float, gamma: float, c: float) -> float:
    """Theorem 3.8 (Leviathan et al. 2023): expected walltime improvement
    (1 − α^(γ+1)) / ((1 − α)(γc + 1)), assuming independent acceptances and a verify pass
    over γ+1 positions that costs one target step. γ = 0 gives 1."""
    if gamma <= 0:
        return 1.0
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + 1)


def cost_model_speedup(acceptance: Sequence[float], gamma: float, costs: CostCurve) -> float:
    """Expected speedup from the measured cost curve and conditional per-position
    acceptance a_1..a_γ: E(γ)/(γ·t_draft + t_verify(γ+1)) over 1/t_verify(1).
    A fractional γ (auto's mean) interpolates between its neighbours."""
    if gamma <= 0:
        return 1.0
    lo, hi = math.floor(gamma), math.ceil(gamma)

    def at(g: int) -> float:
        a = list(acceptance) + [acceptance[-1] if acceptance else 0.0] * max(0, g - len(acceptance))
        return expected_tokens(a, g) / costs.round_time(g, full_acceptance(a, g)) * costs.verify_time(1)

    if lo == hi:
        return at(lo)
    return at(lo) + (gamma - lo) * (at(hi) - at(lo))


def token_md5(tokens: Sequence[int]) -> str:
    """md5 of the generated token ids (comma-separated decimal), the identity fingerprint."""
    return hashlib.md5(",".join(map(str, tokens)).encode()).hexdigest()


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first token where `a` and `b` differ (or where one ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def weight_bandwidth(stats: Stats, target_bytes: int, draft_bytes: int) -> float:
    """Achieved weight bandwidth in bytes/s during decode: weights read by every target and
    draft forward, over decode time (KV-cache reads not counted)."""
    if stats.decode_time <= 0:
        return 0.0
    read = target_bytes * stats.target_forwards + draft_bytes * stats.draft_forwards
    return read / stats.decode_time


def parse_gammas(values: Sequence[str]) -> list[Gamma]:
    """'1,2,3' / ['1', '2', 'auto'] → [1, 2, 3, 'auto'], validated, duplicates dropped."""
    out: list[Gamma] = []
    for value in values:
        for part in str(value).replace(" ", ",").split(","):
            if not part:
                continue
            if part == "auto":
                g: Gamma = "auto"
            else:
                try:
                    g = int(part)
                except ValueError:
                    raise MlxSpecError(f"γ must be a whole number or 'auto', not {part!r}") from None
                if not 1 <= g <= 16:
                    raise MlxSpecError(f"γ must be between 1 and 16 in a sweep (γ = 0 is the baseline), not {g}")
            if g not in out:
                out.append(g)
    if not out:
        raise MlxSpecError("the γ list is empty")
    return out


# ---------------------------------------------------------------------------------------
# Committed prompts
# ---------------------------------------------------------------------------------------


def committed_prompts() -> dict[str, str]:
    """The fixed bench prompts by name: short, long, window (longer than a 512-token
    sliding window in the Gemma tokenizer) and quote (asks for a passage to be copied, where
    prompt-lookup drafting shines)."""
    return {p.stem: p.read_text() for p in sorted(PROMPT_DIR.glob("*.txt"))}


def resolve_prompt(spec: str) -> tuple[str, str]:
    """(name, text) for a committed prompt name, '@file', or literal text."""
    prompts = committed_prompts()
    if spec in prompts:
        return spec, prompts[spec]
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            return path.name, path.read_text()
        except OSError as error:
            raise MlxSpecError(f"cannot read prompt file {path}: {error.strerror}") from None
    if not spec.strip():
        raise MlxSpecError("the prompt is empty")
    return "custom", spec


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """One generation: a setting on a prompt, cold (first) or warm."""

    prompt: str
    setting: str  # "off", "γ=3", "auto"
    gamma: Gamma  # 0 for the baseline
    rep: int  # 0 = cold
    tokens: list[int] = field(repr=False)
    stats: Stats = field(repr=False)
    md5: str = ""
    bandwidth: float = 0.0  # bytes/s
    mismatch_at: Optional[int] = None  # first token differing from the baseline (T = 0)

    @property
    def cold(self) -> bool:
        return self.rep == 0


@dataclass
class SettingSummary:
    """Warm-run medians and aggregates of one setting on one prompt."""

    prompt: str
    setting: str
    gamma: Gamma
    runs: int
    decode_tps: float  # median over warm runs
    tps_min: float
    tps_max: float
    spread: float  # (max − min) / median
    speedup: float  # vs the baseline's median
    cold_tps: float
    cold_prefill_time: float
    acceptance_rate: float  # α̂ over warm runs
    acceptance_by_position: list[float]
    conditional_acceptance: list[float]
    mean_accepted_length: float
    mean_gamma: float  # drafted / rounds (auto varies γ)
    prefill_time: float  # median, seconds
    prefill_share: float  # prefill / (prefill + decode), median
    predicted_speedup: float  # Theorem 3.8 with α̂, c and mean γ (a lookup drafter may draft < γ)
    cost_model_speedup: float  # measured verify curve and per-position acceptance
    bandwidth: float  # bytes/s, median
    peak_memory: int
    generated: int  # tokens per run (median)
    md5: str  # of the cold run's tokens
    identical: Optional[bool]  # all runs equal the baseline (None above T = 0)
    mismatch_at: Optional[int]  # first differing token index of the first mismatching run


@dataclass
class Mismatch:
    prompt: str
    setting: str
    rep: int
    index: int

    def __str__(self) -> str:
        kind = "cold run" if self.rep == 0 else f"warm run {self.rep}"
        return (f"output differs from the baseline: prompt {self.prompt!r}, setting {self.setting}, "
                f"{kind}, first differing token index {self.index}")


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

    @property
    def identity_checked(self) -> bool:
        return self.params.greedy

    @property
    def ok(self) -> bool:
        return not self.mismatches

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
            "mismatches": [asdict(m) for m in self.mismatches],
            "recommendation": {"setting": self.recommendation, "speedup": self.recommended_speedup},
            "costs": {**asdict(self.costs), "c": self.costs.c},
            "settings": [asdict(s) for s in self.summaries],
        }


CSV_FIELDS = (
    "prompt", "setting", "gamma", "runs", "decode_tps", "tps_min", "tps_max", "spread",
    "speedup", "predicted_speedup", "cost_model_speedup", "cold_tps", "acceptance_rate",
    "acceptance_by_position", "mean_accepted_length", "mean_gamma", "prefill_time",
    "prefill_share", "bandwidth", "peak_memory", "generated", "md5", "identical", "mismatch_at",
)


def csv_rows(result: SweepResult) -> list[dict]:
    """One flat row per (prompt, setting); per-position acceptance as 'a1;a2;...'."""
    rows = []
    for s in result.summaries:
        row = {k: getattr(s, k) for k in CSV_FIELDS}
        row["acceptance_by_position"] = ";".join(f"{a:.4f}" for a in s.acceptance_by_position)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------


def setting_label(gamma: Gamma) -> str:
    return BASELINE if gamma == 0 else ("auto" if gamma == "auto" else f"γ={gamma}")


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
) -> SweepResult:
    """Sweep γ against a drafting-off baseline.

    Args:
        pair: a loaded `ModelPair` (target, optional draft, tokenizer, vocab widths).
        prompts: name → prompt token ids.
        drafter: "model", "ngram" or None (model when the pair has a draft, else ngram).
        gammas: the γ values (and/or "auto") to compare with the baseline.
        warm_runs: timed runs per setting after the cold one.
        max_tokens: tokens generated per run.
        params: sampling; at temperature 0 every run's tokens must equal the baseline's.
        progress: called with (runs done, runs total, description) after each run.
        calibration_progress: called with (done, total) while the cost curve is measured.
    Returns:
        A `SweepResult`; `.ok` is False when an output differed from the baseline.
    """
    if not prompts:
        raise MlxSpecError("no prompts to benchmark")
    if warm_runs < 1:
        raise MlxSpecError("--runs must be at least 1")
    plain = build_engine(pair, "none")
    spec = build_engine(pair, drafter)
    if spec.drafter is None:
        raise MlxSpecError("the sweep needs a drafter: --drafter model or ngram")
    drafter_name = spec.drafter.name
    draft_model = getattr(spec.drafter, "model", None)
    target_bytes = weight_bytes(spec.target)
    draft_bytes = weight_bytes(draft_model) if draft_model is not None else 0

    # The cost curve gives c for Theorem 3.8 and the cost-model prediction; measured once
    # per pair/machine/context bucket and cached (the same entry --gamma auto reads).
    longest = max(len(ids) for ids in prompts.values())
    numeric = [g for g in gammas if g != "auto"]
    width = max([MAX_AUTO_GAMMA] + numeric) + 1
    costs = load_or_measure(spec.target, draft_model, max_width=width,
                            context=context_bucket(longest), progress=calibration_progress)

    settings: list[Gamma] = [0] + list(gammas)
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
                policy = (gamma_policy("auto", spec, context=len(ids), progress=calibration_progress)
                          if gamma == "auto" else FixedGamma(gamma))
                runs.append(_one_run(engine, ids, params, policy, max_tokens, name, label, gamma, rep,
                                     target_bytes, draft_bytes))
                done += 1
    if progress:
        progress(done, total, "done")

    mismatches = _check_identity(runs) if params.greedy else []
    summaries = [
        _summarize([r for r in runs if r.prompt == name and r.setting == setting_label(g)], costs, params)
        for name in prompts for g in settings
    ]
    _fill_speedups(summaries)
    recommendation, speedup = recommend(summaries)
    return SweepResult(summaries, runs, mismatches, recommendation, speedup, costs, params,
                       {k: len(v) for k, v in prompts.items()}, drafter_name, max_tokens, warm_runs)


def _one_run(engine: Engine, ids, params, policy, max_tokens, prompt, label, gamma, rep,
             target_bytes, draft_bytes) -> Run:
    stats = Stats()
    mx.reset_peak_memory()
    tokens: list[int] = []
    for rnd in engine.rounds(ids, params, gamma=policy, max_tokens=max_tokens, stats=stats):
        tokens += rnd.tokens
    bandwidth = weight_bandwidth(stats, target_bytes, draft_bytes if engine.drafter else 0)
    return Run(prompt, label, gamma, rep, tokens, stats, token_md5(tokens), bandwidth)


def _check_identity(runs: list[Run]) -> list[Mismatch]:
    """Every run's tokens against the baseline's cold run on the same prompt."""
    reference = {r.prompt: r for r in runs if r.setting == BASELINE and r.cold}
    mismatches = []
    for r in runs:
        ref = reference[r.prompt]
        if r is ref or r.md5 == ref.md5:
            continue
        r.mismatch_at = first_difference(r.tokens, ref.tokens)
        if r.mismatch_at is not None:
            mismatches.append(Mismatch(r.prompt, r.setting, r.rep, r.mismatch_at))
    return mismatches


def _summarize(runs: list[Run], costs: CostCurve, params: SamplingParams) -> SettingSummary:
    cold = next(r for r in runs if r.cold)
    warm = [r for r in runs if not r.cold] or [cold]
    tps = [r.stats.decode_tps for r in warm]
    med = statistics.median(tps)
    drafted = sum(r.stats.drafted for r in warm)
    accepted = sum(r.stats.accepted for r in warm)
    rounds = sum(r.stats.rounds for r in warm)
    alpha = accepted / drafted if drafted else 0.0
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
        predicted_speedup=theorem_speedup(alpha, mean_gamma, costs.c),
        cost_model_speedup=cost_model_speedup(conditional, mean_gamma, costs),
        bandwidth=statistics.median(r.bandwidth for r in warm),
        peak_memory=max(r.stats.peak_memory for r in runs),
        generated=int(statistics.median(r.stats.generated for r in warm)),
        md5=cold.md5,
        identical=None if not params.greedy else not mismatched,
        mismatch_at=mismatched[0].mismatch_at if mismatched else None,
    )


def _fill_speedups(summaries: list[SettingSummary]) -> None:
    base = {s.prompt: s.decode_tps for s in summaries if s.setting == BASELINE}
    for s in summaries:
        s.speedup = s.decode_tps / base[s.prompt] if base[s.prompt] else 0.0


def recommend(summaries: list[SettingSummary]) -> tuple[str, float]:
    """The setting with the highest geometric-mean speedup over prompts among those whose
    output matched the baseline (or was not checked); the baseline when nothing beats it."""
    by_setting: dict[str, list[float]] = {}
    excluded = {s.setting for s in summaries if s.identical is False}
    for s in summaries:
        if s.setting not in excluded:
            by_setting.setdefault(s.setting, []).append(max(s.speedup, 1e-9))
    means = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in by_setting.items()}
    best = max(means, key=lambda k: (means[k], k == BASELINE))
    return best, means[best]


def recommendation_text(result: SweepResult) -> str:
    """One line for people: which setting to use, and whether the gain is within the noise."""
    best = result.recommendation
    if best == BASELINE:
        return "recommendation: drafting does not pay here; use --gamma 0 (or --gamma auto, which parks at 0)"
    flag = "--gamma auto" if best == "auto" else f"--gamma {best.split('=')[1]}"
    line = f"recommendation: {flag} ({result.recommended_speedup:.2f}× vs drafting off)"
    noise = max((s.spread / 2 for s in result.summaries if s.setting in (best, BASELINE)), default=0.0)
    if result.recommended_speedup - 1 <= noise:
        line += f", within the run-to-run spread (±{noise:.0%}): drafting does not clearly pay here"
    return line
