"""Which matmuls the BLAS under MLX moves: a float32 matmul (the 270M's LM head, 640 ×
262144) and a 4-bit quantized one (a Gemma 3 12B MLP projection, 3840 × 15360, group 64, as
the mlx-community checkpoints and `bench/shaped.py` quantize), by rows M (a verify of M
positions), under the wheel's reference BLAS and the optimised one mlx-spec loads.

Each BLAS runs in its own worker process (it is chosen when mlx.core loads); workers
alternate. Medians of the repeats after a warm-up.

Also recorded, for the figures docs/performance.md quotes:
- how far row 0 of an M-row float32 product is from the 1-row product of the same row
  (MKL picks other kernels for more rows, so a verify can round a logit differently from
  a decode step; `row_difference`);
- the LM head's time over 1, 16 and 64 rows under the optimised BLAS on 1 and on every
  core's worth of threads, on an idle machine and beside processes that keep one core, or
  every core, busy (what the default thread counts rest on, `blas.default_threads` for a
  few rows and `blas.wide_threads` from `blas.WIDE_ROWS` rows on; `threads`).

    python bench/blas_matmul.py --workers 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ROWS = (1, 2, 4, 8)
THREAD_ROWS = (1, 16, 64)  # a decode step, a batch's verify, a prefill chunk
SHAPES = {"float32 LM head (640 x 262144)": (640, 262144, None),
          "4-bit MLP projection (3840 x 15360)": (3840, 15360, 4)}


def worker(repeats: int, head_only: bool = False) -> None:
    import mlx.core as mx

    import mlx_spec  # noqa: F401  (loads the BLAS named by $MLX_SPEC_BLAS first)
    from mlx_spec.runtime import blas
    out = {"blas": blas.describe(), "ms": {}, "row_difference": {}}
    for name, (d_in, d_out, bits) in list(SHAPES.items())[: 1 if head_only else None]:
        w = mx.random.normal((d_out, d_in), key=mx.random.key(0)) * 0.02
        if bits:
            wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
            mx.eval(wq, scales, biases)

            def forward(x):
                return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=bits)
        else:
            mx.eval(w)

            def forward(x):
                return x @ w.T
        out["ms"][name] = {}
        for rows in THREAD_ROWS if head_only else ROWS:
            x = mx.random.normal((rows, d_in), key=mx.random.key(rows))
            if not bits and not head_only:  # row 0 alone against row 0 of the M-row product
                alone, together = forward(x[:1]), forward(x)[:1]
                gap = mx.max(mx.abs(alone - together)).item()
                out["row_difference"][str(rows)] = {"max_abs": gap, "relative": gap / mx.max(mx.abs(alone)).item()}
            mx.eval(forward(x))  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                mx.eval(forward(x))
                times.append(time.perf_counter() - start)
            out["ms"][name][str(rows)] = 1000 * sorted(times)[len(times) // 2]
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes per BLAS")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--head-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.repeats, args.head_only)

    import os
    import subprocess

    from common import blas_worker, median, quiet_machine, write_results

    before = quiet_machine()

    results = {"reference": [], "fast": []}
    for _ in range(args.workers):
        for name, requested in (("reference", "reference"), ("fast", "auto")):
            results[name].append(blas_worker(__file__, requested, "--repeats", str(args.repeats)))
    table = {}
    for name, runs in results.items():
        table[name] = {"blas": runs[0]["blas"], "ms": {
            shape: {rows: median([r["ms"][shape][rows] for r in runs]) for rows in runs[0]["ms"][shape]}
            for shape in runs[0]["ms"]}, "row_difference": {
            rows: {k: median([r["row_difference"][rows][k] for r in runs]) for k in ("max_abs", "relative")}
            for rows in runs[0]["row_difference"]}}
    head = next(iter(SHAPES))
    threads = {}
    cores = os.cpu_count() or 1
    for busy in sorted({0, 1, cores}):  # cores kept busy by other processes
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for count in sorted({1, cores}):
                runs = [blas_worker(__file__, "auto", "--repeats", str(args.repeats), "--head-only",
                                    env={"MLX_SPEC_BLAS_THREADS": str(count)}) for _ in range(args.workers)]
                load = "idle" if not busy else f"{busy} core{'s' * (busy > 1)} busy"
                threads[f"{count} thread{'s' * (count > 1)}, {load}"] = {
                    "blas_threads": runs[0]["blas"]["threads"],
                    "ms": {rows: median([r["ms"][head][rows] for r in runs]) for rows in runs[0]["ms"][head]}}
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    for shape in SHAPES:
        for name in table:
            ms = table[name]["ms"][shape]
            print(f"{shape:40s} {table[name]['blas']['name']:>9s}: " + "  ".join(
                f"M={rows} {ms[rows]:7.1f} ms ({ms[rows] / ms['1']:.2f}x)" for rows in ms))
    for name in table:
        print(f"row 0 of M rows vs alone, {table[name]['blas']['name']}: " + "  ".join(
            f"M={rows} {d['max_abs']:.1e} ({d['relative']:.1e} rel.)" for rows, d in table[name]["row_difference"].items()))
    for k, v in threads.items():
        print(f"LM head, {k}: " + "  ".join(f"M={rows} {ms:.0f} ms" for rows, ms in v["ms"].items()))
    path = write_results("blas_matmul", {"workers": args.workers, "repeats": args.repeats,
                                         "other_processes_cores_before": before, **table,
                                         "threads": threads})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
