"""What the BLAS under MLX buys: the embedded Gemma 3 270M (float32, greedy) decoding plainly,
with the n-gram drafter at γ = auto and at a fixed γ, under the wheel's reference BLAS and
the optimised one mlx-spec loads (MKL on x86-64 Linux), side by side in one run.

The BLAS is chosen when mlx.core loads, so each one runs in its own worker process; the
workers alternate (reference, fast, reference, fast, ...), each calibrating its own cost
curve (as `--gamma auto` would on that machine state), warming up, then timing every
setting on every prompt in rotated order. Medians over workers; ratios of medians, and
auto/plain paired within each worker. Every output's token md5 is recorded: at T = 0 all
settings and BLAS must give the same text (a difference is reported with its position).

    python bench/blas.py                                   # quote + long, 96 tokens, 2 workers each
    python bench/blas.py --prompts quote --max-tokens 32 --workers 1    # a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SETTINGS = ("plain", "auto", "γ=3")


def worker(args) -> None:
    from common import environment
    from pairs import build

    import mlx_spec  # noqa: F401  (loads the BLAS named by $MLX_SPEC_BLAS first)
    from mlx_spec.apps.calibration import measure_costs
    from mlx_spec.apps.runner import MAX_AUTO_GAMMA, context_bucket
    from mlx_spec.core.engine import Engine
    from mlx_spec.core.policy import AutoGamma
    from mlx_spec.core.sampling import SamplingParams
    from mlx_spec.core.stats import Stats
    from mlx_spec.runtime import blas

    pairs = {name: build("gemma270m-ngram", name) for name in args.prompts}
    first = next(iter(pairs.values()))
    start = time.perf_counter()
    costs = measure_costs(first.target, None, max_width=MAX_AUTO_GAMMA + 1,
                          context=context_bucket(max(len(p.prompt) for p in pairs.values())))
    calibration_s = time.perf_counter() - start

    def run(pair, setting, max_tokens):
        policy = {"plain": 0, "γ=3": 3}.get(setting) if setting != "auto" else AutoGamma(costs, max_gamma=MAX_AUTO_GAMMA)
        stats = Stats()
        engine = Engine(pair.target, pair.make_drafter())
        tokens = [t for r in engine.rounds(pair.prompt, SamplingParams(), gamma=policy, max_tokens=max_tokens,
                                           stats=stats) for t in r.tokens]
        return stats, tokens

    for pair in pairs.values():  # warm-up: kernels, allocations
        for setting in SETTINGS:
            run(pair, setting, 8)
    out = {"blas": blas.describe(), "environment": environment(), "calibration_s": calibration_s,
           "cost_curve_steps": [t / costs.verify[0] for t in costs.verify], "step_s": costs.verify[0], "runs": []}
    cells = [(p, s) for p in args.prompts for s in SETTINGS]
    for rep in range(args.repeats):
        for name, setting in cells[rep % len(cells):] + cells[: rep % len(cells)]:
            stats, tokens = run(pairs[name], setting, args.max_tokens)
            out["runs"].append({"prompt": name, "setting": setting, "rep": rep, "decode_tps": stats.decode_tps,
                                "drafted": stats.drafted, "accepted": stats.accepted, "rounds": stats.rounds,
                                "md5": hashlib.md5(json.dumps(tokens).encode()).hexdigest(), "tokens": tokens})
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", nargs="+", default=["quote", "long"])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per setting in each worker")
    parser.add_argument("--workers", type=int, default=2, help="worker processes per BLAS, alternating")
    parser.add_argument("--blas", nargs="+", default=["reference", "auto"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from common import blas_worker, median, write_results

    results = {b: [] for b in args.blas}
    for w in range(args.workers):
        for b in (args.blas if w % 2 == 0 else args.blas[::-1]):
            t0 = time.perf_counter()
            results[b].append(blas_worker(__file__, b, "--prompts", *args.prompts, "--max-tokens", str(args.max_tokens),
                                          "--repeats", str(args.repeats)))
            print(f"worker {w + 1}/{args.workers} BLAS {b}: {time.perf_counter() - t0:.0f} s "
                  f"({results[b][-1]['blas']['name']})", flush=True)

    def tps(b, prompt, setting):
        return [r["decode_tps"] for res in results[b] for r in res["runs"]
                if r["prompt"] == prompt and r["setting"] == setting]

    def paired(b, prompt, setting):
        """setting / plain within each worker and repetition (drift cancels)."""
        out = []
        for res in results[b]:
            by = {(r["rep"], r["setting"]): r["decode_tps"] for r in res["runs"] if r["prompt"] == prompt}
            out += [by[(rep, setting)] / by[(rep, "plain")] for rep in range(args.repeats)]
        return median(out)

    ref, fast = args.blas[0], args.blas[-1]
    table, identity = {}, {}
    for prompt in args.prompts:
        reference_tokens = next(r["tokens"] for r in results[ref][0]["runs"]
                                if r["prompt"] == prompt and r["setting"] == "plain")
        diffs = []
        for b in args.blas:
            for res in results[b]:
                for r in res["runs"]:
                    if r["prompt"] == prompt and r["tokens"] != reference_tokens:
                        at = next((i for i, (x, y) in enumerate(zip(r["tokens"], reference_tokens)) if x != y),
                                  min(len(r["tokens"]), len(reference_tokens)))
                        diffs.append({"blas": b, "setting": r["setting"], "first_difference_at": at})
        identity[prompt] = {"identical": not diffs, "differences": diffs}
        for b in args.blas:
            for s in SETTINGS:
                table[f"{prompt}|{b}|{s}"] = {"median_tps": median(tps(b, prompt, s)), "runs": tps(b, prompt, s)}
    ratios = {}
    for prompt in args.prompts:
        ref_plain = median(tps(ref, prompt, "plain"))
        ratios[prompt] = {
            "fast_plain_over_reference_plain": median(tps(fast, prompt, "plain")) / ref_plain,
            "fast_auto_over_reference_plain": median(tps(fast, prompt, "auto")) / ref_plain,
            "fast_auto_over_fast_plain_paired": paired(fast, prompt, "auto"),
            "fast_gamma3_over_fast_plain_paired": paired(fast, prompt, "γ=3"),
            "reference_auto_over_reference_plain_paired": paired(ref, prompt, "auto"),
            "reference_gamma3_over_reference_plain_paired": paired(ref, prompt, "γ=3"),
        }
    print(f"\n{'prompt':<8} {'BLAS':<10} " + " ".join(f"{s:>8}" for s in SETTINGS) + "   tok/s, medians")
    for prompt in args.prompts:
        for b in args.blas:
            name = results[b][0]["blas"]["name"]
            print(f"{prompt:<8} {name:<10} " + " ".join(f"{table[f'{prompt}|{b}|{s}']['median_tps']:8.2f}"
                                                     for s in SETTINGS))
        r = ratios[prompt]
        print(f"  {fast} plain / reference plain {r['fast_plain_over_reference_plain']:.2f}×, "
              f"{fast} auto / reference plain {r['fast_auto_over_reference_plain']:.2f}×, "
              f"auto / plain ({fast}, paired) {r['fast_auto_over_fast_plain_paired']:.2f}×; "
              f"identical text: {identity[prompt]['identical']}")
    curves = {}  # medians over workers: a step, and a verify of w rows in steps
    for b in args.blas:
        widths = min(len(res["cost_curve_steps"]) for res in results[b])  # a hopeless curve stops early
        curves[b] = {"step_s": median([res["step_s"] for res in results[b]]),
                     "verify_steps": [median([res["cost_curve_steps"][w] for res in results[b]])
                                      for w in range(widths)]}
        print(f"cost curve, {results[b][0]['blas']['name']} (medians of {len(results[b])} workers): step "
              f"{curves[b]['step_s'] * 1e3:.1f} ms, verify of w rows / one step "
              f"{[round(v, 2) for v in curves[b]['verify_steps']]}")
    for res_list in results.values():
        for res in res_list:
            for r in res["runs"]:
                del r["tokens"]
    path = write_results("blas_gemma270m-ngram", {
        "max_tokens": args.max_tokens, "repeats_per_worker": args.repeats, "workers_per_blas": args.workers,
        "prompts": args.prompts, "medians": table, "cost_curves": curves, "ratios": ratios, "identity": identity,
        "workers": {b: [{k: v for k, v in res.items() if k != "environment"} for res in results[b]]
                    for b in args.blas},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
