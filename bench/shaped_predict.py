"""What the cost model predicts for Gemma 4 12B with each of its drafters (the MTP
assistant, the seed's; DSpark; DFlash) at their published acceptance, on Apple-GPU-shaped
verify curves and on the curve measured at full size on an H200: the γ it would choose and
the speedup over plain decoding there. Nothing is timed: predictions only.

    speedup(γ) = E(γ) / (draft(γ) + t(γ + 1)),  E(γ) = 1 + Σ_{k≤γ} Π_{m≤k} a_m   (target steps)

draft(γ) is γ·c for the assistant (one step a token) and c for a block drafter (one
forward a block). c on a Mac, where a step reads every weight once: the bytes a draft
forward reads over the target's (shaped_nvidia-h200_full.json's weight bytes; DFlash also
reads the target's 262144 × 3840 embedding as its head). On the H200: c as measured there.
Curves: apple-bf16 / apple-4bit (DESIGN.md §5's M3 Ultra matmul measurements, as
shaped_concurrency.py uses them) and the H200's measured t(w) for the 12B at 4-bit.
Acceptance: scripted.PROFILES (seed: the reference run's MTP per-position rates; dspark12b,
dflash12b: flat rates with the published mean accepted length).

    python bench/shaped_predict.py        # writes bench/results/shaped_predict.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_results  # noqa: E402
from scripted import PROFILES, profile_at  # noqa: E402
from shaped_concurrency import curve_from, curves  # noqa: E402

from mlx_spec.core.cost_model import CostCurve  # noqa: E402
from mlx_spec.core.policy import cost_model_speedup  # noqa: E402

MEASURED = "shaped_nvidia-h200_full.json"
HEAD_BYTES = 262144 * 3840 * (4 + 2 * 16 / 64) / 8  # the target's 4-bit g64 embedding, read as DFlash's head


def predict() -> dict:
    measured = json.loads((RESULTS / MEASURED).read_text())
    pairs = {p["pair"]: p for p in measured["pairs"]}
    h200 = curve_from({w + 1: t for w, t in enumerate(pairs["gemma4-12b/dflash"]["costs"]["verify_over_step"])},
                      flat_after=True)
    shapes = {**{k: v for k, v in curves().items() if k.startswith("apple")}, "nvidia-h200 (measured)": h200}
    out = {}
    for name, pair in pairs.items():
        costs = pair["costs"]
        draft_bytes = costs["draft_weight_bytes"] + (HEAD_BYTES if name.endswith("dflash") else 0)
        profile = PROFILES[pair["published_profile"]]
        block, max_gamma = pair["block_drafter"], pair["max_gamma"]
        rows = {}
        for shape, curve in shapes.items():
            c = costs["c"] if shape.startswith("nvidia") else draft_bytes / costs["target_weight_bytes"]
            model = CostCurve(curve.verify, c, curve.context, wide=curve.wide, block=block)
            speedups = {g: cost_model_speedup(model, [profile_at(profile, i) for i in range(max_gamma)], g)
                        for g in range(0, max_gamma + 1)}  # γ 0: plain decoding, 1×
            best = max(speedups, key=speedups.get)
            rows[shape] = {"c": c, "best_gamma": best, "speedup": speedups[best],
                           "speedup_by_gamma": speedups}
        out[name] = {"acceptance": list(profile), "published_profile": pair["published_profile"],
                     "block_drafter": block, "by_curve": rows}
    return {"description": "cost-model predictions for Gemma 4 12B's drafters at published acceptance "
                           "(bench/shaped_predict.py)", "from": MEASURED, "pairs": out}


def main() -> int:
    results = predict()
    for name, pair in results["pairs"].items():
        cells = [f"{shape}: γ {r['best_gamma']} → {r['speedup']:.2f}× (c {r['c']:.2f})"
                 for shape, r in pair["by_curve"].items()]
        print(f"{name:22} " + " · ".join(cells))
    print(f"wrote {write_results('shaped_predict', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
