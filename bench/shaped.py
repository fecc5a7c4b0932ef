"""Speculative decoding's speed on real model shapes at a scripted acceptance profile, on
whatever MLX device this runs on (Apple GPU, CUDA GPU or CPU).

Random-weight models with the exact shapes of real checkpoints (Gemma 4 12B with its MTP
assistant, the seed's pair, and with its DSpark and DFlash block drafts; Gemma 3 12B / 27B
targets with 270M / 1B drafts; 4-bit group 64 as their mlx-community checkpoints;
shapes.py), a drafter that runs the real-shaped draft's forwards but proposes tokens the
target accepts with a given per-position probability (scripted.py), and the real round loop
(`Engine.rounds`). `--profiles published` plays each pair's published acceptance (the
seed's measured profile for the MTP pair, the block drafts' published mean accepted length).
Reports cost curves, achieved weight bandwidth, and measured tok/s for γ = 0..6 and auto
next to the cost model's prediction and Theorem 3.8 (shaped_measure.py).

    python bench/shaped.py                        # full size, all pairs: ~17 GB at most
    python bench/shaped.py --pairs gemma4-12b/assistant --scale 0.125 --prompt-tokens 256
    python bench/shaped.py --pairs gemma4-12b/assistant gemma4-12b/dspark gemma4-12b/dflash \
        --profiles published --gammas 0 1 2 3 4 5 6 7 9 11 15

Writes bench/results/shaped_<device>_<scale>.json and docs/shaped_<device>_<scale>.png.
A run at --scale below 1 measures scaled-down shapes: its numbers describe those shapes on
this device, not the real models.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
from common import write_results  # noqa: E402
from scripted import PROFILES, parse_profile  # noqa: E402

PUBLISHED = "published"  # --profiles' name for each pair's own published profile
from shaped_measure import (  # noqa: E402
    MAX_WIDTH,
    best_gamma,
    clock,
    device_label,
    device_name,
    greedy_reference,
    log_stderr,
    measure_costs_for,
    median_curve,
    prompt_ids,
    run_profile,
    scripted_drafter,
    summarize,
    timed,
)
from shapes import PAIRS, SHAPES, build  # noqa: E402

from mlx_spec.apps.sweep import first_difference, logit_gap  # noqa: E402
from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.cost_model import weight_bytes  # noqa: E402
from mlx_spec.core.sampling import SamplingParams  # noqa: E402
from mlx_spec.core.stats import Stats  # noqa: E402
from mlx_spec.errors import MlxSpecError  # noqa: E402
from mlx_spec.loading.loader import default_dtype  # noqa: E402

DOCS = Path(__file__).parent.parent / "docs"


def scale_label(scale: float) -> str:
    return "full" if scale == 1 else f"x{scale:g}"


def measure(pairs: list[str], profiles: dict, *, scale: float = 1.0, dtype: str | None = None,
            gammas=range(7), auto: bool = True, max_width: int = MAX_WIDTH, prompt_tokens: int = 1660,
            max_tokens: int = 128, repeats: int = 3, clock_name: str = "wall", built: dict | None = None,
            log=log_stderr) -> dict:
    """Measure each pair at each profile; returns the JSON-ready results.

    `clock_name`: "wall", or "cpu" for this process's CPU time (CPU device only).
    Models are built once per shape (into `built`, shape name -> model, which a caller may
    pre-fill) and freed when no later pair needs them, so at most one target is in memory
    at a time when pairs are grouped by target (as PAIRS lists them).
    """
    dtype = dtype or default_dtype()
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        raise MlxSpecError(f"unknown pair {unknown[0]!r}: choose from {', '.join(PAIRS)}")
    built = {} if built is None else built

    def model(name: str, seed: int):
        if name not in built:
            log(f"building {name} (scale {scale:g}, {dtype}, 4-bit g64)")
            in_use = sum(weight_bytes(m) for m in built.values())
            built[name] = build(SHAPES[name], scale=scale, dtype=dtype, seed=seed, in_use=in_use)
        return built[name]

    out = []
    with clock(clock_name):
        for k, pair_name in enumerate(pairs):
            out.append(_measure_pair(pairs, k, built, model, profiles, gammas=gammas, auto=auto,
                                     max_width=max_width, prompt_tokens=prompt_tokens,
                                     max_tokens=max_tokens, repeats=repeats, log=log))
    return {
        "description": "Gemma-shaped random-weight pairs at scripted acceptance (bench/shaped.py)",
        "device": device_name(),
        "scale": scale,
        "measured_at_full_size": scale == 1,
        "dtype": dtype,
        "clock": clock_name,
        "quantization": {"bits": 4, "group_size": 64},
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "temperature": 0.0,
        "pairs": out,
    }


def _measure_pair(pairs: list[str], k: int, built: dict, model, profiles: dict, *, gammas, auto,
                  max_width, prompt_tokens, max_tokens, repeats, log) -> dict:
    """Pair `pairs[k]`: its reference continuation, cost curve and every profile's runs.
    γ runs up to what the pair's drafter can propose in a round (`Pair.max_gamma`), auto
    γ weighs the same range, and a block drafter's round is priced per draft forward."""
    pair_name = pairs[k]
    pair = PAIRS[pair_name]
    gammas = [g for g in gammas if g <= pair.max_gamma]
    max_width = max(max_width, max(gammas) + 1, pair.max_gamma + 1 if auto else 0)
    profiles = {name: PROFILES[pair.published] if name == PUBLISHED else profile
                for name, profile in profiles.items()}
    needed = {n for p in pairs[k:] for n in (PAIRS[p].target, PAIRS[p].draft)}
    for name in [n for n in built if n not in needed]:  # free what no remaining pair uses
        del built[name]
    gc.collect()
    mx.clear_cache()
    target, draft = model(pair.target, 0), model(pair.draft, 1)
    ids = prompt_ids(prompt_tokens, target.config["vocab_size"])
    log(f"[{pair_name}] reference: {max_tokens} tokens of plain greedy decoding (mlx-lm generate_step, "
        "and the engine at γ = 0)")
    mlx_lm_reference, reference_s = timed(greedy_reference, target, ids, max_tokens)
    # The script proposes the engine's own plain continuation: in bfloat16 on a GPU, mlx-lm's
    # prefill (one chunk of 2048) and ours (chunks of 512) round differently, and where the
    # first token is a near-tie the two texts part at once; a script of mlx-lm's tokens would
    # then be rejected from the first round on, at any profile (seen on an H200).
    reference = plain_reference(target, ids, max_tokens)
    plain_vs_mlx_lm = first_difference(reference, mlx_lm_reference)
    log(f"[{pair_name}] cost curve: widths 1..{max_width} and a draft step at {prompt_tokens} tokens of context")
    costs = measure_costs_for(target, draft, prompt_tokens, max_width)
    curve = replace(costs["curve"], block=pair.block)
    log(f"[{pair_name}] step {curve.verify[0] * 1e3:.1f} ms, c = {curve.c:.3f}, verify/step "
        + " ".join(f"{x:.2f}" for x in costs["json"]["verify_over_step"]))
    if pair.make_drafter:  # a drafter that is not a standalone model (an MTP head)
        def make_drafter(ref, prof, seed):
            return pair.make_drafter(target, draft, ref, prof, seed)
    else:
        make_drafter = scripted_drafter(target, draft, ids)
    result = {
        "pair": pair_name,
        "target": {"shape": pair.target, "checkpoint": SHAPES[pair.target].checkpoint,
                   "source": SHAPES[pair.target].source, "config": target.config},
        "draft": {"shape": pair.draft, "checkpoint": SHAPES[pair.draft].checkpoint,
                  "source": SHAPES[pair.draft].source, "config": draft.config},
        "max_gamma": pair.max_gamma,
        "block_drafter": pair.block,
        "published_profile": pair.published,
        "reference_s": reference_s,
        "plain_vs_mlx_lm": _mismatch(target, ids, mlx_lm_reference, plain_vs_mlx_lm),
        "costs": costs["json"],
        "profiles": {},
    }
    for profile_name, profile in profiles.items():
        log(f"[{pair_name}] profile {profile_name}: {', '.join(f'{a:g}' for a in profile)}")
        curves = [curve]  # and re-measured before each warm repetition

        def recost():
            curves.append(replace(measure_costs_for(target, draft, prompt_tokens, max_width)["curve"], block=pair.block))
            return curves[-1]

        runs = run_profile(target, make_drafter, ids, reference, curve, profile, gammas=list(gammas),
                           auto=auto, max_gamma=pair.max_gamma, max_tokens=max_tokens, repeats=repeats,
                           recost=recost, log=log)
        typical = median_curve(curves)
        result["profiles"][profile_name] = {
            "acceptance": list(profile),
            "cost_model_best_gamma": best_gamma(profile, typical, pair.max_gamma),
            "cost_curve_median": {"verify_over_step": [t / typical.verify[0] for t in typical.verify],
                                  "target_step_s": typical.verify[0], "c": typical.c},
            "target_step_s_by_repetition": [c.verify[0] for c in curves],
            "settings": summarize(runs, reference, typical, profile,
                                  (costs["json"]["target_weight_bytes"], costs["json"]["draft_weight_bytes"])),
        }
        for setting in result["profiles"][profile_name]["settings"]:
            # On a GPU a multi-row verify and a one-row step round differently: a first
            # difference where the target's top-2 logits tie to rounding is a near-tie
            # (mlx-spec bench's rule), not an exactness failure.
            if setting["first_mismatch"] is not None:
                mismatch = _mismatch(target, ids, reference, setting["first_mismatch"])
                setting.update(mismatch_logit_gap=mismatch["logit_gap"],
                               near_tie_tolerance=mismatch["near_tie_tolerance"], near_tie=mismatch["near_tie"])
    return result


def plain_reference(target, ids: list[int], max_tokens: int) -> list[int]:
    """The engine's own plain greedy decoding (γ = 0) of `ids`."""
    tokens = []
    for r in Engine(target, None).rounds(ids, SamplingParams(), gamma=0, max_tokens=max_tokens, stats=Stats()):
        tokens += r.tokens
    return tokens


def _mismatch(target, ids: list[int], reference: list[int], at) -> dict:
    """Where a text first parts from `reference` (None: it does not), and whether the
    target's top two logits there tie to rounding (mlx-spec bench's near-tie rule)."""
    if at is None:
        return {"first_mismatch": None}
    gap, tolerance = logit_gap(target, ids + reference[:at], SamplingParams())
    return {"first_mismatch": at, "logit_gap": gap, "near_tie_tolerance": tolerance, "near_tie": gap <= tolerance}


def print_table(results: dict) -> None:
    for pair in results["pairs"]:
        c = pair["costs"]
        print(f"\n{pair['pair']} on {results['device']} · scale {results['scale']:g} · {results['dtype']} · "
              f"step {c['target_step_s'] * 1e3:.1f} ms · c = {c['c']:.3f} · target "
              f"{c['target_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"
              + (f" ({c['target_bandwidth_fraction']:.0%} of {c['nominal_chip']}'s nominal)"
                 if c["target_bandwidth_fraction"] else ""))
        print("verify w / step: " + " ".join(f"{w + 1}:{x:.2f}" for w, x in enumerate(c["verify_over_step"])))
        for name, prof in pair["profiles"].items():
            print(f"profile {name} ({', '.join(f'{a:g}' for a in prof['acceptance'])}); "
                  f"cost model's best γ = {prof['cost_model_best_gamma']}")
            print(f"{'setting':>8} {'tok/s':>9} {'speedup':>8} {'predicted':>9} {'meas/pred':>9} "
                  f"{'Thm 3.8':>8} {'α':>6} {'α̂':>6} {'max|z|':>7} {'exact':>6}")
            for s in prof["settings"]:
                ratio = s["measured_over_predicted"]
                print(f"{s['setting']:>8} {s['decode_tps']['median']:9.2f} {s['speedup']:7.2f}× "
                      f"{s['predicted_speedup_profile']:8.2f}× {ratio if ratio else float('nan'):9.3f} "
                      f"{s['theorem_3_8']:7.2f}× {s['alpha_iid']:6.3f} {s['acceptance_rate']:6.3f} {s['max_abs_z']:7.2f} "
                      f"{'yes' if s['identical_to_reference'] else 'NO':>6}")


def markdown_table(results: dict, profile: str = "seed") -> str:
    """docs/performance.md's table: speedup over γ = 0 per γ at one profile, measured (cost model)."""
    fixed = list(dict.fromkeys(s["setting"] for pair in results["pairs"] for s in pair["profiles"][profile]["settings"]
                               if s["setting"] != "γ=0"))
    head = ["pair", "c", "verify 2 / 4 / 7 rows ÷ step", *fixed, "measured ÷ predicted"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pair in results["pairs"]:
        settings = {s["setting"]: s for s in pair["profiles"][profile]["settings"]}
        curve = pair["profiles"][profile]["cost_curve_median"]
        ratios = [s["measured_over_predicted"] for s in settings.values() if s["measured_over_predicted"]]
        cells = [pair["pair"], f"{curve['c']:.2f}",
                 " / ".join(f"{curve['verify_over_step'][w - 1]:.2f}" for w in (2, 4, 7))]
        for name in fixed:
            s = settings.get(name)  # a block drafter's γ runs past the others'
            cells.append(f"{s['speedup']:.2f}× ({s['predicted_speedup_profile']:.2f})" if s else "—")
        cells.append(f"{min(ratios):.2f}–{max(ratios):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    """Speedup vs γ per pair (rows) and profile (columns): measured, cost model, Thm 3.8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = results["pairs"]
    names = list(pairs[0]["profiles"])
    fig, axes = plt.subplots(len(pairs), len(names), figsize=(5 * len(names), 3.6 * len(pairs)), squeeze=False)
    for row, pair in zip(axes, pairs):
        for ax, name in zip(row, names):
            settings = pair["profiles"][name]["settings"]
            fixed = [s for s in settings if s["setting"] != "auto"]
            g = [int(s["setting"].split("=")[1]) for s in fixed]
            ax.plot(g, [s["speedup"] for s in fixed], "o-", label="measured")
            ax.plot(g, [s["predicted_speedup_profile"] for s in fixed], "s--", label="cost model")
            ax.plot(g, [s["theorem_3_8"] for s in fixed], ":", label="Thm 3.8 (α, c)")
            for s in settings:
                if s["setting"] == "auto":
                    ax.plot([s["mean_gamma"]], [s["speedup"]], "*", ms=12, label="auto (mean γ)")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_title(f"{pair['pair']} · {name}", fontsize=10)
            ax.set_xlabel("γ")
            ax.set_ylabel("speedup vs γ = 0")
            ax.legend(fontsize=7)
    fig.suptitle(f"{results['device']} · scale {results['scale']:g} · {results['dtype']} · 4-bit g64 · "
                 f"{'process CPU time' if results['clock'] == 'cpu' else 'wall time'} "
                 f"(random weights, real shapes{'' if results['scale'] == 1 else ' scaled down'})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help=f"from: {', '.join(PAIRS)}")
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES),
                        help=f"named ({', '.join(PROFILES)}), {PUBLISHED} (each pair's own) or a_1,a_2,... "
                             "(conditional acceptance by position)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink widths, vocabulary and depth (1 = real shapes)")
    parser.add_argument("--dtype", default=None, help="float dtype of scales/norms/activations (default: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--gammas", type=int, nargs="+", default=list(range(7)), help="fixed γ values (0 = plain decoding)")
    parser.add_argument("--no-auto", action="store_true", help="skip γ = auto")
    parser.add_argument("--prompt-tokens", type=int, default=1660, help="context before decoding (the seed measured at 1660)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="warm runs per setting, after one cold run")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time (default), or this process's CPU time on a CPU shared with other jobs")
    parser.add_argument("--name", help="results file name, without .json (default: shaped_<device>_<scale>)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="measure nothing: print the tables and redraw the plot of a results file")
    args = parser.parse_args(argv)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        print_table(results)
        for name in ("seed", PUBLISHED):
            if name in results["pairs"][0]["profiles"]:
                print("\n" + markdown_table(results, name))
        if not args.no_plot:
            print(f"wrote {plot(results, DOCS / (args.from_json.stem + '.png'))}")
        return 0
    try:
        profiles = dict((PUBLISHED, None) if p == PUBLISHED else parse_profile(p) for p in args.profiles)
        if not 0 < args.scale <= 1:
            raise MlxSpecError("--scale must be in (0, 1]")
        if args.prompt_tokens < 2 or args.max_tokens < 2:
            raise MlxSpecError("--prompt-tokens and --max-tokens must be at least 2")
        gammas = sorted(set([0] + args.gammas))
        results = measure(args.pairs, profiles, scale=args.scale, dtype=args.dtype, gammas=gammas,
                          auto=not args.no_auto, prompt_tokens=args.prompt_tokens,
                          max_tokens=args.max_tokens, repeats=args.repeats, clock_name=args.clock)
    except (MlxSpecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(results)
    for name in ("seed", PUBLISHED):
        if name in profiles:
            print("\n" + markdown_table(results, name))
    name = args.name or f"shaped_{device_label()}_{scale_label(args.scale)}"
    print(f"wrote {write_results(name, results)}")
    if not args.no_plot:
        print(f"wrote {plot(results, DOCS / f'{name}.png')}")
    settings = [s for p in results["pairs"] for pr in p["profiles"].values() for s in pr["settings"]]
    if any(s.get("near_tie") for s in settings):
        print("note: some outputs first differ from plain greedy decoding at a numerical near-tie "
              "(see near_tie, mismatch_logit_gap)", file=sys.stderr)
    for p in results["pairs"]:
        m = p["plain_vs_mlx_lm"]
        if m["first_mismatch"] is not None:
            print(f"note: [{p['pair']}] plain decoding parts from mlx-lm's generate_step at token "
                  f"{m['first_mismatch']} (logit gap {m['logit_gap']:.3g}, near-tie tolerance "
                  f"{m['near_tie_tolerance']:.3g})", file=sys.stderr)
    if not all(s["identical_to_reference"] or s.get("near_tie") for s in settings):
        print("error: an output differed from plain greedy decoding (see identical_to_reference)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head: stop quietly
        sys.stderr.close()
        sys.exit(0)
