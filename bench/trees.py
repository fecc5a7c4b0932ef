"""Draft trees beside chains: does verifying several continuations in one pass beat the best
chain in tokens per second, on this machine's verify cost curve?

One `run_sweep` (what `mlx-spec bench --tree` runs) per prompt: plain decoding, fixed chains
γ = 1..6, auto γ and the cost-curve-shaped tree, one cold run then N warm runs, interleaved
across settings; medians, md5 identity against plain decoding, the cost model's prediction.
Per-repetition (paired) ratios tree / best chain cancel the drift of a shared CPU.

    python bench/trees.py --prompts quote long --max-tokens 96 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402
from pairs import gemma270m, gemma_prompt_ids  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlx_spec.models.pairing import ModelPair  # noqa: E402
from mlx_spec.sampling import SamplingParams  # noqa: E402
from mlx_spec.sweep import TREE, run_sweep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", nargs="+", default=["quote", "long"])
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    # the embedded Gemma 3 270M with the n-gram drafter (the drafter that branches)
    loaded = gemma270m(args.dtype)
    width = int(loaded.model(mx.array([[2]])).shape[-1])
    pair = ModelPair(loaded, None, loaded.tokenizer, width, None)
    name = "gemma270m-ngram" if args.dtype == "float32" else "gemma270m-bf16-ngram"
    results = {}
    for prompt in args.prompts:
        ids = gemma_prompt_ids(loaded.tokenizer, prompt)
        sweep = run_sweep(pair, {prompt: ids}, drafter="ngram",
                          gammas=[*args.gammas, "auto", TREE], warm_runs=args.repeats,
                          max_tokens=args.max_tokens, params=SamplingParams())
        by = {s.setting: s for s in sweep.summaries}
        chains = [s for s in sweep.summaries if s.setting not in ("off", TREE)]
        best = max(chains, key=lambda s: s.decode_tps)
        warm = [r for r in sweep.runs if not r.cold]
        paired = [t.stats.decode_tps / b.stats.decode_tps
                  for t in warm if t.setting == TREE
                  for b in warm if b.setting == best.setting and b.rep == t.rep]
        tree = by[TREE]
        results[prompt] = {
            "prompt_tokens": len(ids),
            "ok": sweep.ok,
            "settings": {s.setting: {
                "decode_tps": s.decode_tps, "tps_min": s.tps_min, "tps_max": s.tps_max, "speedup": s.speedup,
                "tokens_per_round": s.mean_accepted_length, "drafted_per_round": s.mean_gamma,
                "acceptance_by_position": s.acceptance_by_position, "acceptance_by_rank": s.acceptance_by_rank,
                "cost_model_speedup": s.cost_model_speedup, "md5": s.md5, "identical": s.identical,
            } for s in sweep.summaries},
            "best_chain": best.setting,
            "tree_over_best_chain": tree.decode_tps / best.decode_tps,
            "tree_over_best_chain_paired_median": median(paired),
            "tree_over_plain": tree.speedup,
            "cost_curve": {"verify_s": sweep.costs.verify, "context": sweep.costs.context},
        }
        print(f"{prompt}: plain {by['off'].decode_tps:.2f} tok/s; best chain {best.setting} {best.decode_tps:.2f} "
              f"({best.mean_accepted_length:.2f} tokens/round); auto {by['auto'].decode_tps:.2f}; tree "
              f"{tree.decode_tps:.2f} ({tree.mean_accepted_length:.2f} tokens/round, {tree.mean_gamma:.1f} "
              f"nodes, by rank {[round(a, 2) for a in tree.acceptance_by_rank]}, forecast "
              f"{tree.cost_model_speedup:.2f}x, measured {tree.speedup:.2f}x); tree/best chain "
              f"{results[prompt]['tree_over_best_chain']:.3f}x (paired {median(paired):.3f}x); identical {sweep.ok}")
        v = sweep.costs.verify
        print("  verify w / 1 step: " + ", ".join(f"{w}: {t / v[0]:.2f}" for w, t in enumerate(v, 1)))
    path = write_results(f"trees_{name}_{'-'.join(args.prompts)}", {
        "pair": name, "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": results,
        "note": "one run_sweep per prompt: settings interleaved per repetition on a CPU shared with other work; "
                "compare ratios within a prompt, not absolute tok/s",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
