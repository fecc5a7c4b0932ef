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

With `--pair` a draft model drafts instead (`ModelDrafter.propose_tree`: the chain, plus
sibling leaves where the draft's top-1 probability is split): plain, fixed chains, auto γ,
the cost-curve tree and a wide tree (every sibling kept) interleaved per repetition, the
same md5 check and paired ratios, and the replay of the wide tree's proposals on this
machine's curve and the Apple-shaped ones (draft step at the c measured here, and at a
draft of 1/15 of the target's bytes, DESIGN.md §2's pair), and on a hypothetical curve
whose extra rows cost 5% of a step each.

    python bench/trees.py --pair layered-tiny-loose --max-tokens 96 --repeats 5 --sampled
    python bench/trees.py --pair gemma270m-q8 --prompts long --gammas 2 4 --max-tokens 48 --repeats 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx_spec  # noqa: F401,E402  (before mlx.core: it loads the optimised BLAS)
import mlx.core as mx  # noqa: E402
from common import median, write_results  # noqa: E402
from pairs import build, gemma270m, gemma_prompt_ids  # noqa: E402

from mlx_spec.apps.calibration import measure_costs  # noqa: E402
from mlx_spec.apps.runner import TREE_BRANCHES, TREE_NODES, Gamma  # noqa: E402
from mlx_spec.apps.sweep import TREE, run_sweep, token_md5  # noqa: E402
from mlx_spec.core.cost_model import CostCurve  # noqa: E402
from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.policy import AutoGamma, FixedGamma, TreePolicy  # noqa: E402
from mlx_spec.core.sampling import SamplingParams  # noqa: E402
from mlx_spec.core.stats import Stats  # noqa: E402
from mlx_spec.drafters import Draft, NgramDrafter  # noqa: E402
from mlx_spec.loading.pairing import ModelPair  # noqa: E402

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


def recording(drafter):
    """`drafter`, keeping every tree it proposes in `drafter.proposed` (for the replay)."""
    drafter.proposed = []
    propose_tree = drafter.propose_tree

    def recorded(gamma, branches, history=None, key=None):
        draft = propose_tree(gamma, branches, history, key)
        drafter.proposed.append(draft)
        return draft

    drafter.propose_tree = recorded
    return drafter


def first_branch(draft: Draft) -> Draft:
    """The chain of first children: what the chain drafter proposes."""
    shape = draft.tree
    keep = [i for i in range(shape.size) if all(shape.rank[j] == 0 for j in shape.path(i))]
    if not keep:
        return Draft.empty()
    return Draft(draft.tokens[mx.array(keep)], tree=shape.subtree(keep), forwards=draft.forwards)


def replay(learned: TreePolicy, proposed: list[Draft], curve: CostCurve, chain: bool) -> float:
    """The cost model's speedup over plain decoding for the recorded trees (or their first
    branches) cut by `TreePolicy` on `curve`, with the acceptance `learned` measured."""
    policy = TreePolicy(curve, max_gamma=DEPTH, max_nodes=TREE_NODES, learn_costs=False)
    policy.reached, policy.taken = learned.reached, learned.taken
    policy.rank_tried, policy.rank_taken = learned.rank_tried, learned.rank_taken
    for draft in proposed:
        if draft.tree is None and draft.tokens.shape[0] == 0:  # nothing matched: a plain round
            policy.forecast_tokens += 1.0
            policy.forecast_seconds += curve.round_time(0)
        else:
            policy.prune(first_branch(draft) if chain and draft.tree is not None else draft)
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
                drafter = recording(NgramDrafter())
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


def apple_curves(full: CostCurve, draft_step: float) -> dict[str, CostCurve]:
    return {k: CostCurve([full.verify[0] * r for r in interpolated(v, TREE_NODES + 1)], draft_step, 256)
            for k, v in APPLE.items()}


def model_drafter_study(target, make_drafter, ids, gammas, max_tokens, repeats):
    """Plain, chains, auto γ, tree (runner's TreePolicy) and a wide tree with a draft model,
    interleaved; the replay of the wide tree's proposals on several curves."""
    costs = measure_costs(target, make_drafter().model, max_width=TREE_NODES + 1, context=256, early_stop=False)
    flat = CostCurve([1.0] * (TREE_NODES + 1), 0.0, 256)
    policies = {
        "off": lambda: FixedGamma(0), **{f"γ={g}": (lambda g=g: FixedGamma(g)) for g in gammas},
        "auto": lambda: AutoGamma(costs, max_gamma=DEPTH),
        TREE: lambda: TreePolicy(costs, max_gamma=DEPTH, branches=TREE_BRANCHES, max_nodes=TREE_NODES),
        "wide tree": lambda: TreePolicy(flat, max_gamma=DEPTH, branches=TREE_BRANCHES, max_nodes=TREE_NODES,
                                        learn_costs=False, decay=1.0, parked_decay=1.0),
    }
    runs = {name: [] for name in policies}
    md5 = {}
    for rep in range(repeats + 1):  # rep 0 warms up
        for name in (list(policies) if rep % 2 else list(policies)[::-1]):
            stats, drafter, policy = Stats(), recording(make_drafter()), policies[name]()
            tokens = [t for r in Engine(target, drafter).rounds(ids, gamma=policy, max_tokens=max_tokens, stats=stats)
                      for t in r.tokens]
            md5.setdefault(name, set()).add(token_md5(tokens))
            if rep:
                runs[name].append(stats)
            if name == "wide tree":
                wide = (stats, drafter, policy)
            if name == TREE:
                forecast = policy.forecast_speedup
    plain = md5["off"]
    tps = {name: [s.decode_tps for s in r] for name, r in runs.items()}
    chains = [n for n in policies if n not in ("off", TREE, "wide tree")]
    best = max(chains, key=lambda n: median(tps[n]))
    settings = {name: {
        "decode_tps": median(tps[name]), "speedup": median(tps[name]) / median(tps["off"]),
        "tokens_per_round": median([s.mean_accepted_length for s in r]),
        "nodes_per_round": median([s.drafted / s.rounds for s in r]),
        "draft_forwards_per_round": median([s.draft_forwards / s.rounds for s in r]),
        "tree_rounds": median([s.tree_rounds for s in r]),
        "acceptance_by_position": r[-1].acceptance_by_position, "acceptance_by_rank": r[-1].acceptance_by_rank,
        "tried_at_rank": r[-1].tried_at_rank, "identical": md5[name] == plain,
    } for name, r in runs.items()}
    stats, drafter, learned = wide
    step = costs.verify[0]
    curves = {"this-cpu": costs, **{f"{k} (c as here)": c for k, c in apple_curves(costs, costs.draft_step).items()},
              **{f"{k} (c=1/15)": c for k, c in apple_curves(costs, step / 15).items()},
              # hypothetical: each extra row 5% of a step (where siblings this rarely right could pay)
              "rows-5% (c=1/15)": CostCurve([step * (1 + 0.05 * w) for w in range(TREE_NODES + 1)], step / 15, 256)}
    predicted = {name: {"tree": replay(learned, drafter.proposed, c, chain=False),
                        "chain": replay(learned, drafter.proposed, c, chain=True),
                        "c": c.draft_step / c.verify[0],
                        "verify_over_step": [t / c.verify[0] for t in c.verify]} for name, c in curves.items()}
    for p in predicted.values():
        p["tree_over_chain"] = p["tree"] / p["chain"]
    paired = [t.decode_tps / b.decode_tps for t, b in zip(runs[TREE], runs[best])]
    return {
        "prompt_tokens": len(ids), "ok": all(v["identical"] for v in settings.values()), "settings": settings,
        "best_chain": best, "tree_over_best_chain": median(tps[TREE]) / median(tps[best]),
        "tree_over_best_chain_paired_median": median(paired),
        "wide_over_best_chain": median(tps["wide tree"]) / median(tps[best]),
        "tree_forecast_speedup_last_run": forecast,
        "cost_curve": {"verify_s": costs.verify, "draft_step_s": costs.draft_step, "c": costs.c},
        "cost_model_replay": predicted,
    }


def sampled_acceptance(target, make_drafter, ids, max_tokens, seeds=6) -> dict:
    """Tokens per round at T = 1 (no timing): the chain γ = 6, wide trees with the tree rule
    as built (a sampled chain token tested with its q, siblings one-hot against
    norm(max(p − q, 0))), and wide trees with every node one-hot (q dropped: exact too, but
    the chain token is accepted with p(x) instead of min(1, p/q))."""
    import mlx_spec.core.engine as engine_module

    rule = engine_module.verify_tree_sampled
    one_hot = lambda x, shape, p, key, q=None: rule(x, shape, p, key, None)  # noqa: E731
    flat = CostCurve([1.0] * (TREE_NODES + 1), 0.0, 256)
    out = {}
    for name, verify in (("chain γ=6", rule), ("tree, q-aware", rule), ("tree, all one-hot", one_hot)):
        engine_module.verify_tree_sampled = verify
        per_seed = []
        try:
            for seed in range(seeds):
                policy = (FixedGamma(6) if name.startswith("chain") else
                          TreePolicy(flat, max_gamma=DEPTH, max_nodes=TREE_NODES, learn_costs=False))
                stats = Stats()
                for _ in Engine(target, make_drafter()).rounds(ids, SamplingParams(temperature=1.0, seed=seed),
                                                               gamma=policy, max_tokens=max_tokens, stats=stats):
                    pass
                per_seed.append(stats.mean_accepted_length)
        finally:
            engine_module.verify_tree_sampled = rule
        out[name] = {"tokens_per_round_mean": sum(per_seed) / len(per_seed), "per_seed": per_seed}
    return out


def print_model_study(prompt, r):
    s, best = r["settings"], r["best_chain"]
    print(f"{prompt}: plain {s['off']['decode_tps']:.2f} tok/s; best chain {best} {s[best]['decode_tps']:.2f} "
          f"({s[best]['tokens_per_round']:.2f} tokens/round); auto {s['auto']['decode_tps']:.2f}; tree "
          f"{s[TREE]['decode_tps']:.2f} ({s[TREE]['tokens_per_round']:.2f} tokens/round, "
          f"{s[TREE]['nodes_per_round']:.1f} nodes, {s[TREE]['tree_rounds']:.0f} tree rounds); tree/best chain "
          f"{r['tree_over_best_chain']:.3f}x (paired {r['tree_over_best_chain_paired_median']:.3f}x); identical {r['ok']}")
    w = s["wide tree"]
    print(f"  wide tree {w['decode_tps']:.2f} tok/s: {w['tokens_per_round']:.2f} tokens/round over "
          f"{w['nodes_per_round']:.1f} nodes, by rank {[round(a, 2) for a in w['acceptance_by_rank']]} "
          f"(tried {w['tried_at_rank']}); c = {r['cost_curve']['c']:.2f}")
    print("  verify w / 1 step: " + ", ".join(f"{w}: {t / r['cost_curve']['verify_s'][0]:.2f}"
                                              for w, t in enumerate(r["cost_curve"]["verify_s"], 1)))
    for curve, p in r["cost_model_replay"].items():
        print(f"  cost model on {curve}: best tree {p['tree']:.2f}x, best chain {p['chain']:.2f}x plain "
              f"(tree/chain {p['tree_over_chain']:.3f}x)")


def main_model_pair(args) -> None:
    results = {}
    prompts = args.prompts if args.pair.startswith("gemma270m") else ["fixed"]  # tiny pairs: one id sequence
    for prompt in prompts:
        pair = build(args.pair, prompt)
        results[prompt] = model_drafter_study(pair.target, pair.make_drafter, pair.prompt, args.gammas,
                                              args.max_tokens, args.repeats)
        print_model_study(prompt, results[prompt])
        if args.sampled:
            results[prompt]["t1_tokens_per_round"] = sampled = sampled_acceptance(
                pair.target, pair.make_drafter, pair.prompt, args.max_tokens)
            print("  T = 1, tokens/round: " + ", ".join(f"{k} {v['tokens_per_round_mean']:.2f}"
                                                       for k, v in sampled.items()))
    path = write_results(f"trees_{args.pair}_{'-'.join(prompts)}", {
        "pair": args.pair, "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": results,
        "note": "settings interleaved per repetition (order reversed every other one) on a CPU shared with other "
                "work; compare ratios within a prompt, not absolute tok/s",
    })
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", nargs="+", default=["quote", "long"])
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pair", default=None, help="a draft-model pair from bench/pairs.py (e.g. layered-tiny, "
                        "gemma270m-q8); default: the 270M with the n-gram drafter")
    parser.add_argument("--sampled", action="store_true", help="with --pair: also tokens per round at T = 1, "
                        "chain vs trees with the q-aware rule vs trees all one-hot")
    args = parser.parse_args()
    if args.pair is not None:
        return main_model_pair(args)

    # the embedded Gemma 3 270M with the n-gram drafter (the drafter that branches)
    loaded = gemma270m(args.dtype)
    width = int(loaded.model(mx.array([[2]])).shape[-1])
    pair = ModelPair(loaded, None, loaded.tokenizer, width, None)
    name = "gemma270m-ngram" if args.dtype == "float32" else "gemma270m-bf16-ngram"
    results = {}
    for prompt in args.prompts:
        ids = gemma_prompt_ids(loaded.tokenizer, prompt)
        sweep = run_sweep(pair, {prompt: ids}, drafter="ngram",
                          gammas=[Gamma.parse(g) for g in (*args.gammas, "auto", TREE)], warm_runs=args.repeats,
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
