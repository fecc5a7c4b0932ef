"""Auto γ versus every fixed γ: does the bandwidth-aware policy find the best setting, and
does it stay out of the way where drafting loses?

For each pair and prompt: plain decoding (γ = 0), fixed γ = 1..6, and `--gamma auto` (cost
curve measured once beforehand, as the CLI caches it), interleaved over repetitions after a
warm-up, median decode tok/s. Reports auto / best fixed γ and auto / plain.

    python bench/auto_gamma.py --pair gemma270m-bf16-ngram --prompt quote
    python bench/auto_gamma.py --pair layered-tiny
    python bench/auto_gamma.py --pair gemma270m-q8 --prompt short
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, spread, write_results  # noqa: E402
from pairs import build  # noqa: E402

from mlx_spec.apps.calibration import measure_costs  # noqa: E402
from mlx_spec.apps.runner import MAX_AUTO_GAMMA, context_bucket  # noqa: E402
from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.policy import AutoGamma  # noqa: E402
from mlx_spec.core.sampling import SamplingParams  # noqa: E402
from mlx_spec.core.stats import Stats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="layered-tiny")
    parser.add_argument("--prompt", default="long")
    parser.add_argument("--gammas", type=int, nargs="+", default=list(range(0, MAX_AUTO_GAMMA + 1)))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temp", type=float, default=0.0)
    args = parser.parse_args()

    pair = build(args.pair, args.prompt)
    start = time.perf_counter()
    # what `--gamma auto` measures on first use (the CLI then reads it from its cache)
    costs = measure_costs(pair.target, pair.draft_model, max_width=MAX_AUTO_GAMMA + 1, context=context_bucket(len(pair.prompt)))
    calibration_s = time.perf_counter() - start
    print(f"calibration {calibration_s:.1f} s: verify {[round(t, 4) for t in costs.verify]}, draft step {costs.draft_step:.4f}")

    settings = {f"γ={g}": g for g in args.gammas}
    settings["auto"] = "auto"
    tps = {name: [] for name in settings}
    outputs, chosen = {}, {}
    names = list(settings)
    for run in range(args.repeats + 1):  # run 0 warms up
        # rotate the order each repetition, so no setting always runs first or last
        for name in names[run % len(names):] + names[: run % len(names)]:
            gamma = settings[name]
            policy = AutoGamma(costs, max_gamma=MAX_AUTO_GAMMA) if gamma == "auto" else gamma
            stats = Stats()
            rounds = list(
                Engine(pair.target, pair.make_drafter()).rounds(
                    pair.prompt, SamplingParams(temperature=args.temp, seed=run), gamma=policy,
                    max_tokens=args.max_tokens, stats=stats,
                )
            )
            if run == 0:
                outputs[name] = [t for r in rounds for t in r.tokens]
                continue
            tps[name].append(stats.decode_tps)
            if gamma == "auto":
                chosen.setdefault("gammas", []).append([r.gamma for r in rounds])
    medians = {name: median(v) for name, v in tps.items()}
    fixed = {name: m for name, m in medians.items() if name != "auto"}
    best = max(fixed, key=fixed.get)
    plain = medians.get("γ=0")
    identical = args.temp > 0 or len({tuple(v) for v in outputs.values()}) == 1
    for name, m in medians.items():
        print(f"{name:>5}: {m:8.2f} tok/s  (spread {spread(tps[name])[0]:.2f}–{spread(tps[name])[1]:.2f})")
    # each repetition ran every setting back to back: per-repetition ratios cancel drift
    paired = [a / b for a, b in zip(tps["auto"], tps[best])]
    paired_plain = [a / b for a, b in zip(tps["auto"], tps["γ=0"])] if plain else []
    summary = {
        "best_fixed": best,
        "auto_over_best_fixed": medians["auto"] / fixed[best],
        "auto_over_best_fixed_paired_median": median(paired),
        "auto_over_plain_paired_median": median(paired_plain) if paired_plain else None,
        "auto_over_plain": medians["auto"] / plain if plain else None,
        "best_fixed_over_plain": fixed[best] / plain if plain else None,
        "outputs_identical": identical,
    }
    print(
        f"best fixed {best}; auto/best {summary['auto_over_best_fixed']:.3f}x "
        f"(paired median {summary['auto_over_best_fixed_paired_median']:.3f}x); "
        f"auto/plain {summary['auto_over_plain']:.3f}x; identical outputs: {identical}"
    )
    # a narrower sweep than the default gets its own file
    swept = "" if args.gammas == list(range(0, MAX_AUTO_GAMMA + 1)) else "_g" + "".join(map(str, args.gammas))
    path = write_results(
        f"auto_gamma_{args.pair}_{args.prompt}{swept}",
        {
            "pair": args.pair, "description": pair.description, "prompt": args.prompt,
            "prompt_tokens": len(pair.prompt), "max_tokens": args.max_tokens,
            "temperature": args.temp, "repeats": args.repeats,
            "cost_curve": {"verify_s": costs.verify, "draft_step_s": costs.draft_step,
                           "draft_step2_s": costs.draft_step2, "context": costs.context},
            "calibration_s": calibration_s,
            "decode_tps": {name: {"median": medians[name], "spread": spread(tps[name])} for name in settings},
            "auto_gammas_per_round": chosen.get("gammas", [])[:1],
            **summary,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
