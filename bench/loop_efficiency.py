"""Loop efficiency: measured decode tok/s versus the cost model's prediction.

The cost model says a round at γ takes T(γ) = γ·t_draft + t_verify(γ+1) (measured cost
curve) and commits L(γ) tokens (the measured mean accepted length), so it predicts
L(γ)/T(γ) tok/s. What the loop adds on top — sampling, verification, rollback, host sync,
Python — shows as measured/predicted < 1. The curve is measured again just before every
run (at the run's middle context), and runs alternate γ order, so both sides of the ratio
see the same machine state: this machine is shared, and its load drifts within minutes.

    python bench/loop_efficiency.py --pair gemma270m-q8 --gammas 1 2 3 4 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, spread, write_results  # noqa: E402
from pairs import build  # noqa: E402

from mlx_spec.apps.calibration import measure_costs  # noqa: E402
from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.sampling import SamplingParams  # noqa: E402
from mlx_spec.core.stats import Stats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="gemma270m-q8")
    parser.add_argument("--prompt", default="long")
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    pair = build(args.pair, args.prompt)
    # The curve is measured again beside every run (just before it, at the run's middle
    # context), not once at the start: on a shared machine the load drifts between a
    # calibration and a run, and that drift is not the loop's overhead.
    context = len(pair.prompt) + args.max_tokens // 2

    def curve_now(gamma: int):
        return measure_costs(pair.target, pair.draft_model, max_width=gamma + 1, context=context,
                             repeats=3, early_stop=False)

    per_gamma = {g: {"measured": [], "predicted": [], "lengths": [], "verify": []} for g in args.gammas}
    for run in range(args.repeats + 1):  # run 0 warms up
        for gamma in (args.gammas if run % 2 == 0 else reversed(args.gammas)):
            curve = curve_now(gamma)
            stats = Stats()
            engine = Engine(pair.target, pair.make_drafter())
            rounds = list(engine.rounds(pair.prompt, SamplingParams(), gamma=gamma, max_tokens=args.max_tokens,
                                        stats=stats))
            if run == 0:
                continue
            # Predict what ran: the last rounds draft fewer than γ when max_tokens is near,
            # and a round after a fully accepted one starts with a two-token draft step.
            round_time, previous_full = 0.0, False
            for r in rounds:
                round_time += curve.round_time(r.gamma, full_acceptance=float(previous_full))
                previous_full = r.gamma > 0 and r.accepted == r.gamma
            row = per_gamma[gamma]
            row["measured"].append(stats.decode_tps)
            row["predicted"].append(stats.generated / round_time)
            row["lengths"].append(stats.mean_accepted_length)
            row["verify"].append(curve.verify_time(gamma + 1))
    rows = []
    for gamma in args.gammas:
        row = per_gamma[gamma]
        measured, predicted = row["measured"], row["predicted"]
        ratio = median(measured) / median(predicted)
        paired = median([m / p for m, p in zip(measured, predicted)])
        rows.append({
            "gamma": gamma,
            "measured_tps": {"median": median(measured), "spread": spread(measured), "runs": measured},
            "predicted_tps": median(predicted),
            "predicted_tps_runs": predicted,
            "verify_s_beside_runs": row["verify"],
            "mean_accepted_length": median(row["lengths"]),
            "measured_over_predicted": ratio,
            "paired_measured_over_predicted": paired,
        })
        print(f"γ={gamma}: measured {median(measured):.2f} tok/s, predicted {median(predicted):.2f}, "
              f"ratio {ratio:.3f} (paired {paired:.3f}), L={median(row['lengths']):.2f}")
    path = write_results(
        f"loop_efficiency_{args.pair}",
        {"pair": args.pair, "description": pair.description, "prompt": args.prompt,
         "prompt_tokens": len(pair.prompt), "max_tokens": args.max_tokens,
         "cost_curve": {"measured": "beside every run, widths 1..γ+1, 3 repeats", "context": context},
         "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
