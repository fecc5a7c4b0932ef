"""Where the draft model runs across ranks: on rank 0 with its tokens broadcast (`root`),
or on every rank (`all`, one all-reduce fewer per drafted round). One launch, both
placements on the same loaded models, alternating run by run (the order rotates), so that
load on the machine hits both alike; reports paired ratios.

    python bench/draft_placement.py --reps 10 --gamma 3 --max-tokens 32

Starts itself under `mlx.launch --backend ring -n 2`; writes
bench/results/draft_placement_tiny.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()",
          "--backend", "ring", "-n", "2", "--"]


def rank_main(args, folder: Path) -> None:
    from mlx_spec.apps import distributed
    from mlx_spec.core.engine import Engine
    from mlx_spec.core.sampling import SamplingParams
    from mlx_spec.core.stats import Stats
    from mlx_spec.drafters import ModelDrafter
    from mlx_spec.drafters.broadcast import BroadcastDrafter

    w = distributed.world()
    pair = distributed.load_pair(w, str(folder / "target"), str(folder / "draft"), draft_on="all",
                                 progress=False)
    replicated = ModelDrafter(pair.draft.model, pair.vocab_size_target)
    broadcast = BroadcastDrafter(w, ModelDrafter(pair.draft.model, pair.vocab_size_target)
                                 if w.is_root else None)
    engines = {name: Engine(pair.target.model, drafter, agree=w.agree_verdict)
               for name, drafter in (("root", broadcast), ("all", replicated))}
    prompt = list(pair.tokenizer.encode("the quick brown fox " * 12))
    times = {name: [] for name in engines}
    outputs = {}
    for rep in range(args.reps + 1):  # rep 0 warms up
        order = list(engines) if rep % 2 else list(engines)[::-1]
        for name in order:
            stats, tokens = Stats(), []
            for rnd in engines[name].rounds(prompt, SamplingParams(), gamma=args.gamma,
                                            max_tokens=args.max_tokens, stats=stats):
                tokens += rnd.tokens
            outputs[name] = tokens
            if rep:
                times[name].append(stats.decode_time / stats.rounds)
    if w.is_root:
        ratios = [a / r for a, r in zip(times["all"], times["root"])]
        print(json.dumps({"round_time_s": {k: statistics.median(v) for k, v in times.items()},
                          "round_time_all_over_root_paired_median": statistics.median(ratios),
                          "ratios": ratios, "outputs_identical": outputs["root"] == outputs["all"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.folder:  # a rank
        return rank_main(args, Path(args.folder))

    from mlx_spec.testing.tiny import perturbed_copy, save_tiny_model, tiny_gemma3

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        target = tiny_gemma3(seed=0, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8)
        save_tiny_model(Path(tmp) / "target", target)
        save_tiny_model(Path(tmp) / "draft", perturbed_copy(target, noise=0.02, seed=1))
        start = time.time()
        result = subprocess.run(LAUNCH + [sys.executable, __file__, "--folder", tmp, "--reps", str(args.reps),
                                          "--gamma", str(args.gamma), "--max-tokens", str(args.max_tokens)],
                                capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(result.stderr[-3000:])
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    payload = {"pair": "tiny Gemma 3 (8 layers, 4 heads / 2 kv heads) + perturbed copy", "ranks": 2,
               "gamma": args.gamma, "max_tokens": args.max_tokens, "reps": args.reps,
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "seconds": time.time() - start, **measured}
    path = write_results("draft_placement_tiny", payload)
    print(f"round time, draft on every rank / on rank 0 (paired median of {args.reps}): "
          f"{measured['round_time_all_over_root_paired_median']:.3f}; outputs identical: "
          f"{measured['outputs_identical']}; {path}")


if __name__ == "__main__":
    main()
