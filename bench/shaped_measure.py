"""Measuring one real-shaped pair: cost curves, weight bandwidth, and the round loop at a
scripted acceptance profile, next to what the cost model and Theorem 3.8 predict.

Per pair (random weights, real shapes, see shapes.py) and profile (see scripted.py):
  1. the reference: the target's greedy continuation by the engine at γ = 0, which the
     scripts propose, checked against mlx-lm's own `generate_step` (where they part, the
     logit gap says whether at a near-tie)
  2. the cost curve: target forwards at widths 1..9 and a draft step (c), at the prompt's
     context; weight bytes read per second against the device's nominal bandwidth
  3. γ = 0 (plain), each fixed γ and auto, one cold run each then `repeats` warm runs,
     order rotated per repetition; every run's tokens must equal the reference
  4. per setting: median tok/s, speedup over plain (of medians, and paired per repetition),
     conditional acceptance per position against the profile (binomial z-scores),
     the cost model's prediction for the profile (E(γ) / (γ·t_draft + t_verify(γ+1))) and
     for the rounds that actually ran, Theorem 3.8 with α̂ and c
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence
from unittest import mock

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx
from mlx_lm.generate import generate_step
from scripted import ScriptedDrafter, profile_at

import mlx_spec.apps.calibration
import mlx_spec.core.engine
from mlx_spec.apps.calibration import measure_costs
from mlx_spec.apps.sweep import first_difference, token_md5
from mlx_spec.core.cost_model import CostCurve, weight_bandwidth, weight_bytes
from mlx_spec.core.engine import Engine
from mlx_spec.core.policy import AutoGamma, cost_model_speedup, theorem_speedup
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.errors import MlxSpecError

MAX_WIDTH = 9  # verify widths measured: 1..9 (γ up to 8)

# Nominal memory bandwidth in GB/s by device name (vendor figures; the best-matching,
# longest name wins). Binned chips are slower: M3 Max 30-core GPU 300, M4 Max 32-core 410.
NOMINAL_GB_S = {
    "M1": 68, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
    "H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "RTX 4090": 1008,
}


def device_name() -> str:
    """What MLX runs on: the GPU's name (Apple or CUDA), or the CPU's."""
    dev = mx.default_device()
    name = mx.device_info().get("device_name") or ""
    if dev.type == mx.DeviceType.cpu:
        return f"CPU ({name or platform.processor() or platform.machine()})"
    return name or "GPU"


def device_label() -> str:
    """A file-name-safe device label: 'cpu', 'apple-m3-pro', 'nvidia-h200'."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    words = "".join(c if c.isalnum() else " " for c in device_name().lower()).split()
    return "-".join(words) or "gpu"


def nominal_bandwidth(name: str) -> tuple[Optional[str], Optional[float]]:
    """(matched chip, bytes/s) from NOMINAL_GB_S, or (None, None) (CPUs: unknown)."""
    if name.startswith("CPU"):
        return None, None
    padded = f" {name} "
    hits = [k for k in NOMINAL_GB_S if f" {k} " in padded or f" {k}-" in padded]
    if not hits:
        return None, None
    chip = max(hits, key=len)
    return chip, NOMINAL_GB_S[chip] * 1e9


@contextmanager
def clock(name: str):
    """Time everything with the wall clock ("wall"), or with this process's CPU time
    ("cpu", CPU device only). On a CPU shared with other jobs their load swings wall-clock
    timings by ±50% from one second to the next; CPU time counts only this process's work
    (all its threads), so cost curves and runs timed minutes apart stay comparable. It
    does not credit overlap (the host preparing a round while the device computes), so
    it is the stricter measure of loop overhead. The engine and the cost curves read their
    clock through module globals, which this swaps for the duration."""
    if name == "wall":
        yield
        return
    if name != "cpu":
        raise MlxSpecError(f"unknown clock {name!r}: wall or cpu")
    if mx.default_device().type != mx.DeviceType.cpu:
        raise MlxSpecError("--clock cpu measures CPU work, so only on the CPU device: use wall on a GPU")
    shim = types.SimpleNamespace(perf_counter=time.process_time, time=time.time)
    with mock.patch.object(mlx_spec.core.engine, "perf_counter", time.process_time), \
            mock.patch.object(mlx_spec.apps.calibration, "time", shim):
        yield


def prompt_ids(n: int, vocab: int) -> list[int]:
    """A fixed pseudo-random prompt of n ids (BOS first): random models have no tokenizer."""
    return [2] + [(7919 * i + 13) % (min(vocab, 256_000) - 300) + 300 for i in range(n - 1)]


def greedy_reference(model, ids: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding by mlx-lm's `generate_step`: the independent reference."""
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens)]


@dataclass
class RunResult:
    setting: str
    rep: int
    tokens: list[int] = field(repr=False)
    stats: Stats = field(repr=False)
    gammas: list[int] = field(repr=False)
    predicted_tps: float  # the cost model for the rounds that ran


def scripted_drafter(target, draft, ids: list[int]) -> Callable:
    """The default drafter factory: `ScriptedDrafter` over a standalone draft model."""
    vocab = target(mx.array([ids[:1]])).shape[-1]  # logits width (padded vocabulary)
    return lambda reference, profile, seed: ScriptedDrafter(draft, vocab, reference, profile, seed)


def predicted_tps(rounds, costs: CostCurve, generated: int) -> float:
    """Tokens over the cost model's time for the rounds that ran (their γ, and a two-token
    first draft step after a fully accepted round), as bench/loop_efficiency.py predicts."""
    total, previous_full = 0.0, False
    for gamma, accepted in rounds:
        total += costs.round_time(gamma, full_acceptance=float(previous_full))
        previous_full = gamma > 0 and accepted == gamma
    return generated / total if total else 0.0


def median_curve(curves: Sequence[CostCurve]) -> CostCurve:
    """Per-width medians of cost curves measured at different times (the expected-speed
    predictions use this; each run is predicted from the curve measured just before it)."""
    def med(values):
        return statistics.median(values)

    return CostCurve([med(c.verify[w] for c in curves) for w in range(len(curves[0].verify))],
                     med(c.draft_step for c in curves), curves[0].context, med(c.draft_step2 for c in curves),
                     block=curves[0].block)


def binomial_z(taken: int, reached: int, a: float) -> float:
    """(â − a) / σ for `taken` of `reached` Bernoulli(a) draws (0 when nothing was drawn,
    inf when a is 0 or 1 and any draw disagreed)."""
    if reached == 0:
        return 0.0
    sigma = math.sqrt(a * (1 - a) / reached)
    diff = taken / reached - a
    return diff / sigma if sigma else (0.0 if diff == 0 else math.inf)


def measure_costs_for(target, draft, context: int, max_width: int = MAX_WIDTH) -> dict:
    """The cost curve and the bandwidth it implies, JSON-ready, plus the CostCurve."""
    costs = measure_costs(target, draft, max_width=max_width, context=context, repeats=5, early_stop=False)
    t_bytes, d_bytes = weight_bytes(target), weight_bytes(draft)
    name = device_name()
    chip, nominal = nominal_bandwidth(name)
    target_bw = t_bytes / costs.verify[0]
    draft_bw = d_bytes / costs.draft_step if costs.draft_step else 0.0
    return {
        "curve": costs,
        "json": {
            "context": context,
            "target_step_s": costs.verify[0],
            "verify_s": costs.verify,
            "verify_over_step": [t / costs.verify[0] for t in costs.verify],
            "draft_step_s": costs.draft_step,
            "draft_step2_s": costs.draft_step2,
            "c": costs.c,
            "target_weight_bytes": t_bytes,
            "draft_weight_bytes": d_bytes,
            "target_bandwidth_bytes_per_s": target_bw,
            "draft_bandwidth_bytes_per_s": draft_bw,
            "nominal_chip": chip,
            "nominal_bandwidth_bytes_per_s": nominal,
            "target_bandwidth_fraction": target_bw / nominal if nominal else None,
        },
    }


def run_profile(target, make_drafter: Callable, ids: list[int], reference: list[int], costs: CostCurve,
                profile: Sequence[float], *, gammas: Sequence[int], auto: bool, max_tokens: int,
                repeats: int, max_gamma: int = 6, recost: Optional[Callable[[], CostCurve]] = None,
                log: Callable[[str], None] = lambda s: None) -> list[RunResult]:
    """Every setting, one cold run (rep 0) then `repeats` warm ones, order rotated.

    Args:
        make_drafter: (reference, profile, seed) -> a fresh scripted drafter.
        max_gamma: the longest draft auto γ weighs (a block drafter's block).
        costs: the cost curve auto decides with, and the cold runs are predicted from.
        recost: re-measures the cost curve before each warm repetition, so each run is
            predicted from costs timed just before it (a shared machine's load drifts).
    """
    settings: list = list(gammas) + (["auto"] if auto else [])
    runs: list[RunResult] = []
    for rep in range(repeats + 1):
        now = recost() if recost and rep > 0 else costs
        for setting in settings[rep % len(settings):] + settings[: rep % len(settings)]:
            label = setting if setting == "auto" else f"γ={setting}"
            # its own acceptance draws per (repetition, setting): pooled runs stay independent
            seed = 1000 * rep + settings.index(setting)
            drafter = None if setting == 0 else make_drafter(reference, profile, seed)
            policy = AutoGamma(costs, max_gamma=max_gamma) if setting == "auto" else setting
            stats = Stats()
            tokens, rounds = [], []
            for r in Engine(target, drafter).rounds(ids, SamplingParams(), gamma=policy,
                                                    max_tokens=max_tokens, stats=stats):
                tokens += r.tokens
                rounds.append((r.gamma, r.accepted))
            runs.append(RunResult(label, rep, tokens, stats, [g for g, _ in rounds],
                                  predicted_tps(rounds, now, stats.generated)))
            log(f"  {label:>5} {'cold' if rep == 0 else f'run {rep}'}: {stats.decode_tps:8.2f} tok/s "
                f"(cost model {runs[-1].predicted_tps:8.2f})")
    return runs


def summarize(runs: list[RunResult], reference: list[int], costs: CostCurve,
              profile: Sequence[float], weights: tuple[int, int] = (0, 0)) -> list[dict]:
    """Per setting: warm-run medians, speedups, acceptance checks and predictions.

    Args:
        costs: the curve for the expected-speed predictions (`median_curve` of all measured).
        weights: (target, draft) weight bytes, for the weight bandwidth achieved in decode.
    """
    labels = list(dict.fromkeys(r.setting for r in runs))
    warm = {s: [r for r in runs if r.setting == s and r.rep > 0] or [r for r in runs if r.setting == s]
            for s in labels}
    plain = warm["γ=0"]
    plain_tps = statistics.median(r.stats.decode_tps for r in plain)
    plain_predicted = statistics.median(r.predicted_tps for r in plain)
    plain_by_rep = {r.rep: r.stats.decode_tps for r in plain}
    rows = []
    for label in labels:
        ws = warm[label]
        tps = [r.stats.decode_tps for r in ws]
        drafted = sum(r.stats.drafted for r in ws)
        accepted = sum(r.stats.accepted for r in ws)
        rounds = sum(r.stats.rounds for r in ws)
        width = max(len(r.stats.reached_at) for r in ws)
        taken = [sum(r.stats.accepted_at[i] for r in ws if i < len(r.stats.accepted_at)) for i in range(width)]
        reached = [sum(r.stats.reached_at[i] for r in ws if i < len(r.stats.reached_at)) for i in range(width)]
        z = [binomial_z(t, n, profile_at(profile, i)) for i, (t, n) in enumerate(zip(taken, reached))]
        alpha = accepted / drafted if drafted else 0.0
        # Theorem 3.8's α is the chance that any one position is accepted, independently.
        # A round stops at its first rejection, so each reached position is one Bernoulli(α)
        # draw and Σ taken / Σ reached estimates it; accepted / drafted counts positions never
        # reached as failures and understates α for γ > 1 (0.59 for α = 0.8 at γ = 4).
        alpha_iid = sum(taken) / sum(reached) if sum(reached) else 0.0
        mean_gamma = drafted / rounds if rounds else 0.0
        # a fixed γ is predicted at γ (the last rounds draft fewer, to stop at max_tokens)
        gamma = mean_gamma if label == "auto" else int(label.split("=")[1])
        mismatch = [first_difference(r.tokens, reference) for r in runs if r.setting == label]
        mismatch = [m for m in mismatch if m is not None]
        ratios = [r.stats.decode_tps / r.predicted_tps for r in ws if r.predicted_tps]
        rows.append({
            "setting": label,
            "warm_runs": len(ws),
            "decode_tps": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
            "speedup": statistics.median(tps) / plain_tps,
            "speedup_paired": statistics.median(
                r.stats.decode_tps / plain_by_rep[r.rep] for r in ws if r.rep in plain_by_rep),
            "mean_gamma": mean_gamma,
            "gammas_chosen": sorted(set(g for r in ws for g in r.gammas)) if label == "auto" else None,
            "acceptance_rate": alpha,
            "alpha_iid": alpha_iid,
            "conditional_acceptance": [t / n if n else None for t, n in zip(taken, reached)],
            "reached": reached,
            "profile": [profile_at(profile, i) for i in range(width)],
            "binomial_z": z,
            "max_abs_z": max((abs(v) for v in z), default=0.0),
            "mean_accepted_length": 1 + accepted / rounds if rounds else 0.0,
            "predicted_speedup_profile": cost_model_speedup(costs, profile, gamma),
            "predicted_speedup_ran": statistics.median(r.predicted_tps for r in ws) / plain_predicted,
            "predicted_tps_ran": statistics.median(r.predicted_tps for r in ws),
            "measured_over_predicted": statistics.median(ratios) if ratios else None,
            "theorem_3_8": theorem_speedup(alpha_iid, mean_gamma, costs.c),
            "identical_to_reference": not mismatch,
            "md5s": sorted({token_md5(r.tokens) for r in runs if r.setting == label}),
            "first_mismatch": mismatch[0] if mismatch else None,
            "generated": ws[0].stats.generated,
            "peak_memory": max(r.stats.peak_memory for r in ws),
            "weight_bandwidth_bytes_per_s": statistics.median(
                weight_bandwidth(r.stats, *weights) for r in ws),
        })
    return rows


def best_gamma(profile: Sequence[float], costs: CostCurve, max_gamma: int = 6) -> int:
    """The γ the cost model picks for this profile (AutoGamma's rule with known acceptance)."""
    policy = AutoGamma(costs, max_gamma=max_gamma)
    return max(range(max_gamma + 1), key=lambda g: policy.rate(g, [profile_at(profile, i) for i in range(max_gamma)]))


def log_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start
