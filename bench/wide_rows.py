"""From how many rows a batched forward should use every free core (`blas.WIDE_ROWS`).

N clients decoded together in-process (`mlx_spec.apps.clients.run_clients`, the batch `serve
--parallel` runs, no HTTP) on the embedded Gemma 3 270M in float32 with MKL, n-gram
drafting at auto γ, greedy, copying and ordinary prompts (`bench/concurrency.py`'s), with
`blas.WIDE_ROWS` set to each candidate in turn: a forward over at least that many rows (the
batch's verify, a prefill chunk) runs on every core other processes leave free
(`blas.free_cores`), narrower ones on the default thread count. One warm-up run per
setting, then --runs repetitions with the settings interleaved; medians of aggregate tok/s,
ratios against the first candidate. Every setting's answers are checked equal.

    python bench/wide_rows.py                    # bench/results/wide_rows.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OtherLoad, median, write_results  # noqa: E402
from concurrency import COPYING, ORDINARY  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,16,8,4", help="WIDE_ROWS candidates; the first is the baseline")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompts", default="copying,ordinary")
    parser.add_argument("--name", default="wide_rows")
    args = parser.parse_args()

    from mlx_spec.apps.clients import run_clients
    from mlx_spec.apps.runner import AUTO, Gamma, build_engine
    from mlx_spec.core.sampling import SamplingParams
    from mlx_spec.loading import load_pair
    from mlx_spec.runtime import blas

    if blas._setter is None:
        raise SystemExit("the BLAS's threads are not ours to set here (no MKL/OpenBLAS, or a thread count in the "
                         "environment): nothing to measure")
    pair = load_pair(None, dtype="float32", progress=False)
    engine = build_engine(pair, "ngram")
    candidates = [int(r) for r in args.rows.split(",")]
    kinds = {"copying": COPYING, "ordinary": ORDINARY}
    load, rows = OtherLoad(), []
    for kind in args.prompts.split(","):
        prompts = [pair.tokenizer.encode(p) for p in kinds[kind][: args.clients]]
        runs: dict[int, list] = {r: [] for r in candidates}
        answers: dict[int, list] = {}
        for repetition in range(args.runs + 1):  # the first: warm-up
            for wide in candidates:
                blas.WIDE_ROWS = wide
                run = run_clients(engine, prompts, Gamma(AUTO), params=SamplingParams(), max_tokens=args.tokens)
                answers.setdefault(wide, [r.tokens for r in run.requests])
                if repetition:
                    runs[wide].append(run.aggregate_tps)
        base = median(runs[candidates[0]])
        row = {"prompts": kind, "clients": args.clients,
               "aggregate_tps": {str(r): median(v) for r, v in runs.items()},
               "runs_tps": {str(r): v for r, v in runs.items()},
               "vs_first": {str(r): median(v) / base for r, v in runs.items()},
               "answers_equal": all(a == answers[candidates[0]] for a in answers.values())}
        print(row, flush=True)
        rows.append(row)
    path = write_results(args.name, {"tokens": args.tokens, "runs": args.runs, "rows": rows,
                                     "other_load_cores": load.cores()})
    print(path)


if __name__ == "__main__":
    main()
