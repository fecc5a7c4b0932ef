"""Shared helpers for the benchmark scripts: timing with warm-up, medians, the pairs we can
build offline, and JSON output (a table for people, one JSON document for scripts)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx

from mlx_spec.platform import blas
from mlx_spec.platform.blas import OtherLoad

RESULTS = Path(__file__).parent / "results"


def timed_tokens(generator_factory):
    """Run one generation; returns (tokens, seconds to the first token, seconds after it)."""
    start = time.perf_counter()
    tokens, first = [], None
    for token in generator_factory():
        if first is None:
            first = time.perf_counter()
        tokens.append(token)
    end = time.perf_counter()
    return tokens, first - start, end - first


def median(values):
    return statistics.median(values) if values else float("nan")


def spread(values):
    """(min, max) of the runs: the honest spread for a handful of repetitions."""
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def environment() -> dict:
    return {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": blas.describe(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


# A run is quiet when the machine's other processes used less than this many cores on
# average while it ran: a 2-thread llama.cpp loses most of its speed to one busy core.
QUIET_OTHER_CORES = 0.15


def uptime() -> dict:
    """`uptime`'s line and the 1/5/15-minute load averages, for a result to say how busy the
    (shared) machine was when it ran."""
    line = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": line, "loadavg": list(os.getloadavg())}


def quiet_machine(seconds: float = 3.0):
    """Others' mean cores over `seconds` of this process sleeping (None where unknown)."""
    load = OtherLoad()
    time.sleep(seconds)
    return load.cores()


def blas_worker(script: str, blas_name: str, *args: str, env: dict | None = None) -> dict:
    """Run `script --worker *args` in a fresh process under the BLAS $MLX_SPEC_BLAS names
    (chosen when mlx.core loads, so each BLAS needs its own process), with `env` added to
    this one's; its last stdout line, as JSON."""
    env = {**os.environ, **(env or {}), "MLX_SPEC_BLAS": blas_name}
    done = subprocess.run([sys.executable, script, "--worker", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"worker {blas_name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2) + "\n")
    return path
