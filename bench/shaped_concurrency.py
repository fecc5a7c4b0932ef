"""The concurrency table (bench/concurrency.py) predicted on Apple-GPU-shaped verify cost
curves, from the cost model the batch-aware policy uses: what `serve --parallel` would give
at 1, 2, 4, 8 concurrent clients, drafting off and on, beside mlx-lm's server (batched
without a draft; serving one request at a time with one).

Per round every running request drafts its own block (a draft model's steps row by row:
γ·c target steps each) and one target forward verifies every row:

    aggregate tok/s = Σ_i E(γ_i) / (Σ_i γ_i·c + t(Σ_i (γ_i + 1)))      (in target steps)
    E(γ) = 1 + Σ_{k≤γ} Π_{m≤k} a_m

γ_i is what `policy.AutoGamma` chooses in a `BatchShare` of N requests (the real policy,
run to its fixed point), or a fixed 3. mlx-lm with a draft model serves one request at a
time, so its aggregate is one request's drafted rate whatever N. Time to first token and
the batch's K/V copies are not modelled. Acceptance: the seed run's per-position profile
(scripted.SEED, DESIGN.md §2).

Curves, t(w) in one-row steps: apple-bf16 and apple-4bit are DESIGN.md §5's M3 Ultra matmul
measurements (bf16 ~2× at 8 rows; 4-bit quantized_matmul 1.8× / 3.3× / 6× at 2 / 4 / 8),
bf16 held at 2× past 8 rows (bandwidth-bound: rows far below the ridge point cost no more
weight reads), 4-bit's last slope extended; this-cpu-x0.125 is the shaped bench's measured
curve for the Gemma 4 12B shape at 1/8 scale on our CPU (shaped_cpu_x0.125.json), its last
slope extended. Absolute tok/s: × the seed's 12B draft-off speed on an M3 Pro (15.3 tok/s).

    python bench/shaped_concurrency.py       # writes bench/results/shaped_concurrency.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_results  # noqa: E402
from scripted import SEED  # noqa: E402

from mlx_spec.core.cost_model import CostCurve  # noqa: E402
from mlx_spec.core.policy import AutoGamma, BatchShare, expected_tokens  # noqa: E402

CLIENTS = (1, 2, 4, 8)
SEED_PLAIN_TPS = 15.3  # DESIGN.md §2: the 12B at 4-bit on an M3 Pro, draft off
DRAFTERS = {"ngram": 0.0, "draft-model": 1 / 15}  # c: draft step / target step (a ~45× smaller draft)
MAX_GAMMA = 6


def curve_from(points: dict[int, float], flat_after: bool = False) -> CostCurve:
    """t(w) through `points` (w → steps), dense to 8 rows, then measured-style wide points
    at 16/32/64: flat past the last point (`flat_after`) or its last slope extended."""
    xs = sorted(points)

    def at(w):
        lo = max(x for x in xs if x <= w)
        hi = min((x for x in xs if x > w), default=None)
        if hi is None:
            if flat_after or len(xs) < 2:
                return points[lo]
            a, b = xs[-2], xs[-1]
            return points[b] + (points[b] - points[a]) / (b - a) * (w - b)
        return points[lo] + (points[hi] - points[lo]) * (w - lo) / (hi - lo)

    return CostCurve([at(w) for w in range(1, 9)], 0.0, 256, wide=[[w, at(w)] for w in (16, 32, 64)])


def curves() -> dict[str, CostCurve]:
    shaped = json.loads((RESULTS / "shaped_cpu_x0.125.json").read_text())
    cpu = next(p for p in shaped["pairs"] if p["pair"] == "gemma4-12b/assistant")["costs"]["verify_over_step"]
    return {"apple-bf16": curve_from({1: 1.0, 8: 2.0}, flat_after=True),
            "apple-4bit": curve_from({1: 1.0, 2: 1.8, 4: 3.3, 8: 6.0}),
            "this-cpu-x0.125": curve_from({w + 1: t for w, t in enumerate(cpu)})}


def batch_gammas(curve: CostCurve, c: float, n: int) -> list[int]:
    """The γ each of n requests settles on with auto γ in one batch (the real policy, each
    request answering the others in turn until no choice changes)."""
    costs = CostCurve(curve.verify, c * curve.verify[0], curve.context, wide=curve.wide)
    share = BatchShare()
    policies = [AutoGamma(costs, max_gamma=MAX_GAMMA, learn_costs=False, batch=share) for _ in range(n)]
    for policy in policies:  # evidence: many rounds at the profile's acceptance
        policy.reached = [1000.0] * MAX_GAMMA
        policy.taken = [1000.0 * a for a in _profile(MAX_GAMMA)]
    choices = None
    for _ in range(20):
        for policy in policies:
            policy.parked = False  # no parking or probing: the choice alone, as in steady state
        now = [policy.choose() for policy in policies]
        if now == choices:
            break
        choices = now
    return choices


def _profile(gamma: int) -> list[float]:
    return [SEED[min(i, len(SEED) - 1)] for i in range(gamma)]


def batch_rate(curve: CostCurve, c: float, gammas: list[int]) -> float:
    """Aggregate tokens per target step of one batch round (the module's formula)."""
    tokens = sum(expected_tokens(_profile(g), g) for g in gammas)
    seconds = sum(g * c for g in gammas) + curve.verify_time(sum(g + 1 for g in gammas)) / curve.verify[0]
    return tokens / seconds


def predict() -> dict:
    out = {}
    for name, curve in curves().items():
        rows = []
        for n in CLIENTS:
            off = batch_rate(curve, 0.0, [0] * n)
            row = {"clients": n, "off": {"aggregate": off, "per_request": off / n}}
            for drafter, c in DRAFTERS.items():
                auto = batch_gammas(curve, c, n)
                for label, gammas in ((f"{drafter} auto", auto), (f"{drafter} γ=3", [3] * n)):
                    rate = batch_rate(curve, c, gammas)
                    row[label] = {"aggregate": rate, "per_request": rate / n, "vs_off": rate / off}
                row[f"{drafter} auto"]["gammas"] = auto
            serial = batch_rate(curve, DRAFTERS["draft-model"], [3])  # one request at a time
            row["mlx-lm draft-model (serial)"] = {"aggregate": serial, "per_request": serial / n,
                                                 "vs_off": serial / off}
            rows.append(row)
        out[name] = {"verify_over_step": {w: curve.verify_time(w) for w in (1, 2, 4, 8, 16, 32, 64)}, "rows": rows}
    return out


def main() -> None:
    predictions = predict()
    path = write_results("shaped_concurrency", {
        "description": __doc__.split("\n\n")[0],
        "units": "tokens per target step (× SEED_PLAIN_TPS for tok/s of the seed's 12B on an M3 Pro)",
        "seed_plain_tps": SEED_PLAIN_TPS, "acceptance": list(_profile(MAX_GAMMA)), "drafters_c": DRAFTERS,
        "curves": predictions})
    for name, result in predictions.items():
        print(f"\n{name}  (aggregate tok/s for the 12B on an M3 Pro; per request in brackets)")
        labels = [k for k in result["rows"][0] if k != "clients"]
        print(f"{'clients':>7} " + " ".join(f"{label:>22}" for label in labels))
        for row in result["rows"]:
            print(f"{row['clients']:>7} " + " ".join(
                f"{row[k]['aggregate'] * SEED_PLAIN_TPS:>13.1f} ({row[k]['per_request'] * SEED_PLAIN_TPS:>5.1f})"
                for k in labels))
    print(json.dumps({"results": str(path)}))


if __name__ == "__main__":
    main()
