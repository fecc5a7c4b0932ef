"""Head-to-head: mlx-spec vs mlx-lm's `speculative_generate_step` vs mlx-lm's plain
`generate_step` — same models, prompt, γ and sampling, one process, interleaved
repetitions after a warm-up, medians. At temperature 0 all three must emit the same tokens.

    python bench/head_to_head.py --pair tiny-self --gammas 0 2 4
    python bench/head_to_head.py --pair gemma270m-q8 --gammas 2 4 --max-tokens 32

tiny-self (a tiny random Gemma 3 drafting for itself: overhead-bound, every draft accepted)
isolates the loop's own cost; pairs are defined in bench/pairs.py. At γ = 0 the comparison
is with mlx-lm's plain generate_step, and with our own loop when it does not pipeline plain
rounds (what the pipelining buys).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_sampler

sys.path.insert(0, str(Path(__file__).parent))
from common import median, spread, timed_tokens, write_results  # noqa: E402
from pairs import build  # noqa: E402

from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.sampling import SamplingParams  # noqa: E402
from mlx_spec.drafters import ModelDrafter  # noqa: E402


def build_pair(name: str):
    """(target, draft, prompt ids, description) for a named pair of bench/pairs.py."""
    pair = build(name, "short")
    if pair.draft_model is None:
        raise SystemExit("head-to-head needs a draft model (mlx-lm has no model-free drafter)")
    return pair.target, pair.draft_model, pair.prompt, pair.description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="tiny-self")
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--out", default=None, help="results name (default: head_to_head_<pair>)")
    args = parser.parse_args()

    target, draft, prompt, description = build_pair(args.pair)
    vocab = target(mx.array([[prompt[0]]])).shape[-1]
    params = SamplingParams(temperature=args.temp, seed=0)
    sampler = make_sampler(args.temp) if args.temp > 0 else None

    def ours(gamma, pipelined=True):
        engine = Engine(target, ModelDrafter(draft, vocab))
        engine.pipeline_plain_rounds = pipelined
        return (t for r in engine.rounds(prompt, params, gamma=gamma, max_tokens=args.max_tokens) for t in r.tokens)

    def mlx_lm_speculative(gamma):
        steps = speculative_generate_step(
            mx.array(prompt), target, draft, num_draft_tokens=gamma, max_tokens=args.max_tokens, sampler=sampler
        )
        return (t for t, _, _ in steps)

    def mlx_lm_plain():
        return (t for t, _ in generate_step(mx.array(prompt), target, max_tokens=args.max_tokens, sampler=sampler))

    rows = []
    for gamma in args.gammas:
        systems = {"mlx-lm generate_step": lambda g: mlx_lm_plain()}
        if gamma:
            systems["mlx-lm speculative_generate_step"] = mlx_lm_speculative
        else:
            systems["mlx-spec, plain rounds not pipelined"] = lambda g: ours(g, pipelined=False)
        systems["mlx-spec"] = ours
        decode_tps = {name: [] for name in systems}
        outputs = {}
        for name, make in systems.items():  # warm-up, and the outputs to compare
            outputs[name] = timed_tokens(lambda: make(gamma))[0]
        names = list(systems)
        for rep in range(args.repeats):  # interleaved, so drift hits every system alike,
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # in a rotating order
                make = systems[name]
                tokens, _, decode_s = timed_tokens(lambda: make(gamma))
                decode_tps[name].append((len(tokens) - 1) / decode_s)
        identical = len({tuple(v) for v in outputs.values()}) == 1
        ours_tps = decode_tps["mlx-spec"]
        plain = median(decode_tps["mlx-lm generate_step"])
        # the system we compare with: mlx-lm's speculative loop, or at γ = 0 its plain loop
        rival = "mlx-lm speculative_generate_step" if gamma else "mlx-lm generate_step"
        # each repetition runs all systems back to back: its ratio cancels slow drift
        paired = [a / b for a, b in zip(ours_tps, decode_tps[rival])]
        row = {
            "gamma": gamma,
            "tokens_identical": identical,
            "decode_tps": {name: {"median": median(v), "spread": spread(v)} for name, v in decode_tps.items()},
            "versus": rival,
            "mlx_spec_vs_mlx_lm": median(ours_tps) / median(decode_tps[rival]),
            "mlx_spec_vs_mlx_lm_paired_median": median(paired),
            "mlx_spec_vs_plain": median(ours_tps) / plain,
        }
        if gamma:
            row["mlx_lm_speculative_vs_plain"] = median(decode_tps[rival]) / plain
        else:
            unpipelined = decode_tps["mlx-spec, plain rounds not pipelined"]
            row["pipelined_vs_not_paired_median"] = median([a / b for a, b in zip(ours_tps, unpipelined)])
        rows.append(row)
        print(
            f"γ={gamma}: mlx-spec {median(ours_tps):7.1f} tok/s | {rival} {median(decode_tps[rival]):7.1f} | "
            f"plain {plain:7.1f} | ours/theirs {row['mlx_spec_vs_mlx_lm']:.3f}x "
            f"(paired median {row['mlx_spec_vs_mlx_lm_paired_median']:.3f}x)"
            + (f" | pipelined/not {row['pipelined_vs_not_paired_median']:.3f}x" if not gamma else "")
            + f" | identical={identical}"
        )
    path = write_results(
        args.out or f"head_to_head_{args.pair}",
        {
            "pair": args.pair,
            "description": description,
            "prompt_tokens": len(prompt),
            "max_tokens": args.max_tokens,
            "temperature": args.temp,
            "repeats": args.repeats,
            "metric": "decode tok/s: tokens after the first / seconds after the first token",
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
