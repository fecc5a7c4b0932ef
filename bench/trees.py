"""Draft trees beside chains: does verifying several continuations in one pass beat the best
chain in tokens per second, on this machine's verify cost curve?

One `run_sweep` (what `mlx-spec bench --tree` runs) per prompt: plain decoding, fixed chains
γ = 1..6, auto γ and the cost-curve-shaped tree, one cold run then N warm runs, interleaved
across settings; medians, md5 identity against plain decoding, the cost model's prediction.
Per-repetition (paired) ratios tree / best chain cancel the drift of a shared CPU.

Then a wide-tree study on the same prompt: every node of the n-gram drafter's trees kept
(up to 12), interleaved with the chain γ = 6, to measure what siblings are worth here
(acceptance by depth and sibling rank) and what width costs; and a replay of those trees
through `TreePolicy`'s cut on other verify cost curves (this CPU's, measured to 13 rows
without early stop, and two Apple-GPU-shaped curves from DESIGN.md §5), so the cost model
says where trees would beat chains.

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

from mlx_spec.costs import CostCurve, measure_costs  # noqa: E402
from mlx_spec.drafters import Draft, NgramDrafter  # noqa: E402
from mlx_spec.engine import Engine  # noqa: E402
from mlx_spec.models.pairing import ModelPair  # noqa: E402
from mlx_spec.policy import FixedGamma, TreePolicy  # noqa: E402
from mlx_spec.runner import TREE_NODES  # noqa: E402
from mlx_spec.sampling import SamplingParams  # noqa: E402
from mlx_spec.stats import Stats  # noqa: E402
from mlx_spec.sweep import TREE, run_sweep, token_md5  # noqa: E402

DEPTH = 6  # the deepest tree, as auto γ's largest γ
# Verify cost by rows, relative to one step, on Apple GPUs (DESIGN.md §5, M3 Ultra, matmul):
# 4-bit quantized_matmul ~1.8x at 2 rows, ~3.3x at 4, ~6x at 8; bf16 ~2x at 8.
APPLE = {"apple-4bit": {1: 1.0, 2: 1.8, 4: 3.3, 8: 6.0}, "apple-bf16": {1: 1.0, 8: 2.0}}


def interpolated(points: dict[int, float], widths: int) -> list[float]:
    """A curve over widths 1..widths, piecewise linear through `points`, its last slope extended."""
    xs = sorted(points)
    out = []
    for w in range(1, widths + 1):
        lo = max([x for x in xs if x <= w])
        hi = min([x for x in xs if x > w], default=None)
        if hi is None:  # past the last point: extend the last segment's slope
            a, b = xs[-2], xs[-1]
            out.append(points[b] + (points[b] - points[a]) / (b - a) * (w - b))
        else:
            out.append(points[lo] + (points[hi] - points[lo]) * (w - lo) / (hi - lo))
    return out


class RecordingNgram(NgramDrafter):
    """The n-gram drafter, keeping every tree it proposes (for the replay)."""

    def __init__(self):
        super().__init__()
        self.proposed = []

    def propose_tree(self, gamma, branches, history=None, key=None):
        draft = super().propose_tree(gamma, branches, history, key)
        self.proposed.append(draft)
        return draft


def first_branch(draft: Draft) -> Draft:
    """The chain of first children: what the chain drafter proposes."""
    shape = draft.tree
    keep = [i for i in range(shape.size) if all(shape.rank[j] == 0 for j in shape.path(i))]
    return Draft(draft.tokens[mx.array(keep)], tree=shape.subtree(keep)) if keep else Draft.empty()


def replay(learned: TreePolicy, proposed: list[Draft], curve: CostCurve, chain: bool) -> float:
    """The cost model's speedup over plain decoding for the recorded trees (or their first
    branches) cut by `TreePolicy` on `curve`, with the acceptance `learned` measured."""
    policy = TreePolicy(curve, max_gamma=DEPTH, max_nodes=TREE_NODES, learn_costs=False)
    policy.reached, policy.taken = learned.reached, learned.taken
    policy.rank_tried, policy.rank_taken = learned.rank_tried, learned.rank_taken
    for draft in proposed:
        if draft.tree is None:  # nothing matched: a plain round
            policy.forecast_tokens += 1.0
            policy.forecast_seconds += curve.round_time(0)
        else:
            policy.prune(first_branch(draft) if chain else draft)
    return policy.forecast_speedup


def wide_tree_study(loaded, ids, max_tokens, repeats, plain_md5):
    """Every node kept (flat calibrated costs, learned acceptance without decay) versus the
    chain γ = 6, interleaved; then the replay on several cost curves."""
    flat = CostCurve([1.0] * (TREE_NODES + 1), 0.0, 256)
    tps = {"wide tree": [], "γ=6": []}
    for rep in range(repeats + 1):  # rep 0 warms up
        for name in (list(tps) if rep % 2 else list(tps)[::-1]):
            stats = Stats()
            if name == "wide tree":
                drafter = RecordingNgram()
                policy = TreePolicy(flat, max_gamma=DEPTH, max_nodes=TREE_NODES, learn_costs=False, decay=1.0,
                                    parked_decay=1.0)
            else:
                drafter, policy = NgramDrafter(), FixedGamma(6)
            tokens = [t for r in Engine(loaded.model, drafter).rounds(ids, gamma=policy, max_tokens=max_tokens,
                                                                        stats=stats) for t in r.tokens]
            assert token_md5(tokens) == plain_md5, f"{name}: output differs from plain decoding"
            if rep:
                tps[name].append(stats.decode_tps)
            if name == "wide tree":
                wide = (stats, drafter, policy)
    stats, drafter, learned = wide
    full = measure_costs(loaded.model, None, max_width=TREE_NODES + 1, context=256, early_stop=False)
    curves = {"this-cpu": full, **{k: CostCurve([full.verify[0] * r for r in interpolated(v, TREE_NODES + 1)],
                                                0.0, 256) for k, v in APPLE.items()}}
    predicted = {name: {"tree": replay(learned, drafter.proposed, c, chain=False),
                        "chain": replay(learned, drafter.proposed, c, chain=True),
                        "verify_over_step": [t / c.verify[0] for t in c.verify]} for name, c in curves.items()}
    for p in predicted.values():
        p["tree_over_chain"] = p["tree"] / p["chain"]
    paired = [a / b for a, b in zip(tps["wide tree"], tps["γ=6"])]
    return {
        "decode_tps": {k: median(v) for k, v in tps.items()},
        "wide_over_chain6_paired_median": median(paired),
        "tokens_per_round": stats.mean_accepted_length, "nodes_per_round": stats.drafted / stats.rounds,
        "tree_rounds": stats.tree_rounds, "acceptance_by_depth": stats.acceptance_by_position,
        "acceptance_by_rank": stats.acceptance_by_rank, "tried_at_rank": stats.tried_at_rank,
        "cost_model": predicted,
    }


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
        study = wide_tree_study(loaded, ids, args.max_tokens, args.repeats, by["off"].md5)
        results[prompt]["wide_tree"] = study
        print(f"  wide tree: {study['tokens_per_round']:.2f} tokens/round over {study['nodes_per_round']:.1f} nodes, "
              f"by rank {[round(a, 2) for a in study['acceptance_by_rank']]}; wide/γ=6 paired "
              f"{study['wide_over_chain6_paired_median']:.3f}x")
        for curve, p in study["cost_model"].items():
            print(f"  cost model on {curve}: best tree {p['tree']:.2f}x, best chain {p['chain']:.2f}x plain "
                  f"(tree/chain {p['tree_over_chain']:.3f}x)")
    path = write_results(f"trees_{name}_{'-'.join(args.prompts)}", {
        "pair": name, "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": results,
        "note": "one run_sweep per prompt: settings interleaved per repetition on a CPU shared with other work; "
                "compare ratios within a prompt, not absolute tok/s",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
