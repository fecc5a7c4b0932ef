"""Where a round's milliseconds go: waiting on the device versus host work, per γ.

Wraps the engine's calls with timers (no profiler overhead on the rest): the round's
sync (`mx.eval` in the engine: the device computing the verify pass), building the target's
forward graph (Python over mlx-lm's layers, before the device starts), and everything
else the host does in a round (policy, drafter: a draft model's graph building too,
verdict, commit, stats). The first round
(it holds the prefill) is left out; rounds at widths other than γ + 1 are kept (they are
the loop's too).

    python bench/loop_profile.py --pair gemma270m-ngram --prompt quote --gammas 1 3 6
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402
from pairs import build  # noqa: E402

import mlx_spec.core.engine as engine_module  # noqa: E402
from mlx_spec.cache.sequence import SequenceCache  # noqa: E402
from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.sampling import SamplingParams  # noqa: E402
from mlx_spec.core.stats import Stats  # noqa: E402


class Timers:
    """Seconds spent inside wrapped callables, by label."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="gemma270m-ngram")
    parser.add_argument("--prompt", default="quote")
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 3, 6])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    pair = build(args.pair, args.prompt)
    timers = Timers()
    timers.wrap(engine_module.mx, "eval", "sync")  # mx.eval: within a round, the engine's sync
    timers.wrap(SequenceCache, "forward", "forward graph")
    rows = []
    for gamma in args.gammas:
        per_run = []
        for run in range(args.repeats + 1):  # run 0 warms up
            engine = Engine(pair.target, pair.make_drafter())
            rounds = engine.rounds(pair.prompt, SamplingParams(), gamma=gamma, max_tokens=args.max_tokens,
                                   stats=Stats())
            next(rounds)  # the prefill's round
            timers.seconds.clear()
            start, count = time.perf_counter(), 0
            for _ in rounds:
                count += 1
            wall = time.perf_counter() - start
            if run == 0:
                continue
            sync, graph = timers.seconds.get("sync", 0.0), timers.seconds.get("forward graph", 0.0)
            per_run.append({"round_ms": 1000 * wall / count, "sync_ms": 1000 * sync / count,
                            "forward_graph_ms": 1000 * graph / count,
                            "other_host_ms": 1000 * (wall - sync - graph) / count, "rounds": count})
        row = {"gamma": gamma, **{k: median([r[k] for r in per_run]) for k in per_run[0]}, "runs": per_run}
        rows.append(row)
        print(f"γ={gamma}: round {row['round_ms']:.1f} ms = sync {row['sync_ms']:.1f} + forward graph "
              f"{row['forward_graph_ms']:.2f} + other host {row['other_host_ms']:.2f} ms")
    path = write_results(f"loop_profile_{args.pair}",
                         {"pair": args.pair, "description": pair.description, "prompt": args.prompt,
                          "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
