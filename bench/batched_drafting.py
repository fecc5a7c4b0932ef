"""Batched drafting (issue 28): the draft phase of one round for 1, 2, 4, 8 requests, their
draft-model steps batched (one forward per step for all rows, `mlx_spec.core.batch`) versus row
by row (one forward per row and step, as before).

Each row is a `ModelDrafter` whose draft cache holds its own prompt (the pair's prompt cut
to a different length per row, so blocks and windows are ragged). A measurement drafts γ
greedy tokens for every row and waits for them; the drafts are then rolled back, so every
repetition does the same work. One warm-up per setting, then --runs repetitions with the
two ways interleaved (their order alternating); medians, and the ratio row-by-row /
batched from the same repetitions.

    python bench/batched_drafting.py                  # writes bench/results/batched_drafting.json
    python bench/batched_drafting.py --pair layered-tiny --name batched_drafting_tiny
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx_spec  # noqa: F401,E402  (before mlx.core: it loads the optimised BLAS)
import mlx.core as mx  # noqa: E402
from common import OtherLoad, median, spread, write_results  # noqa: E402
from pairs import PAIRS, build  # noqa: E402

from mlx_spec.core.cache.sequence import PromptCache  # noqa: E402
from mlx_spec.core.passes import run_alone, run_passes  # noqa: E402
from mlx_spec.core.sampling import LogitProcessor, SamplingParams  # noqa: E402


def drafters_for(pair, rows: int, gamma: int) -> list:
    """`rows` (drafter, prompt) pairs, each drafter begun on its own cut of the pair's prompt."""
    out = []
    for i in range(rows):
        prompt = pair.prompt[: len(pair.prompt) - 7 * i]
        drafter = pair.make_drafter()
        drafter.begin(prompt, PromptCache(pair.target, slack=gamma + 1), LogitProcessor(SamplingParams()))
        out.append((drafter, prompt))
    return out


def draft_round(drafters: list, gamma: int, batched: bool) -> float:
    """Seconds to draft γ tokens for every row (on the device, waited for); then the drafts
    are rolled back."""
    key = mx.random.key(0)
    start = time.perf_counter()
    steps = [drafter.drafting(gamma, prompt, key) for drafter, prompt in drafters]
    if batched:  # what `Batch.step` does with the rows' draft passes
        drafts, pending = [], {s: next(s) for s in steps}
        while pending:
            run_passes(list(pending.values()))
            for s in list(pending):
                try:
                    pending[s] = next(s)
                except StopIteration as done:
                    drafts.append(done.value)
                    del pending[s]
    else:
        drafts = [run_alone(s) for s in steps]
    mx.eval([d.tokens for d in drafts])
    seconds = time.perf_counter() - start
    for drafter, _ in drafters:
        drafter.state.settle([])
        drafter.fed_drafts = None
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="gemma270m-q8", choices=[p for p in PAIRS if "ngram" not in p])
    parser.add_argument("--prompt", default="long")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--name", default="batched_drafting")
    args = parser.parse_args()

    pair = build(args.pair, args.prompt)
    load, results = OtherLoad(), []
    print(f"{'rows':>4} {'row by row s':>13} {'batched s':>10} {'ratio':>6}")
    for rows in args.rows:
        drafters = drafters_for(pair, rows, args.gamma)
        times = {False: [], True: []}
        for run in range(args.runs + 1):
            for batched in ((False, True) if run % 2 else (True, False)):
                seconds = draft_round(drafters, args.gamma, batched)
                if run:  # run 0 warms up
                    times[batched].append(seconds)
        ratios = [a / b for a, b in zip(times[False], times[True])]
        result = {"rows": rows, "row_by_row_s": median(times[False]), "batched_s": median(times[True]),
                  "ratio": median(ratios), "ratio_spread": spread(ratios),
                  "row_by_row_runs": times[False], "batched_runs": times[True]}
        results.append(result)
        print(f"{rows:>4} {result['row_by_row_s']:>13.3f} {result['batched_s']:>10.3f} {result['ratio']:>6.2f}")
    path = write_results(args.name, {
        "pair": args.pair, "description": pair.description, "prompt": args.prompt,
        "prompt_tokens": len(pair.prompt), "gamma": args.gamma, "runs": args.runs,
        "other_load_cores": load.cores(),
        "note": "draft phase of one round (γ greedy draft steps for every row, waited for); "
                "ratio = row-by-row seconds / batched seconds, per repetition, median",
        "results": results})
    print(path)


if __name__ == "__main__":
    main()
