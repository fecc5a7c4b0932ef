"""Where a warm run's seconds go: `mlx-spec generate -n 1` on the embedded default once its
import and cost curve are cached (issue 10: the README said later runs "load in a second").

    python bench/startup.py --repeats 5                      # this checkout
    python bench/startup.py --repeats 5 --before ../old-main # and another checkout, interleaved

Each repetition runs, in fresh processes: `python -c "import mlx_spec.cli"` (imports),
`python -m mlx_spec.cli --help`, `python -m mlx_spec.cli generate -n 1` (the whole run) and
`python -m mlx_spec.cli chat` with stdin at its end (so it leaves at its first prompt), plus one in-process breakdown (import, weights, tokenizer, calibration read, first token:
the prefill and first token of `Hello` with the default preset's drafter and γ = auto).
Medians of wall-clock seconds (and of the CPU seconds of `generate -n 1`, which a loaded
machine moves less); checkouts alternate so drift hits both alike.

Before them, `--first-runs` first runs of `generate -n 1`, each from an empty mlx-spec
cache (the GGUF import, the cost-curve calibration, the float32 copy and the tokenizer
index), are timed too: `first_run_s` (wall and CPU seconds) and its excess over a later
run. The machine's load (`uptime`) is recorded before, after the first runs, and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, uptime, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import mlx_spec.cli  # noqa: F401  (what every command imports)
t1 = time.perf_counter()
try:
    from mlx_spec.loading.checkpoints import load_folder
    from mlx_spec.loading.sources import resolve_source
    from mlx_spec.loading.tokenizer_loading import load_tokenizer
except ImportError:  # a checkout from before loader.py was split
    from mlx_spec.loading.loader import load_folder, load_tokenizer, resolve_source
path, _ = resolve_source(None, progress=False)
try:
    model, config = load_folder(path, dtype="float32")  # a float32 copy where there is one
except TypeError:  # a checkout from before the copy
    model, config = load_folder(path)
import mlx.core as mx
model.set_dtype(mx.float32)
mx.eval(model.parameters())
t2 = time.perf_counter()
tokenizer = load_tokenizer(path, config)
t3 = time.perf_counter()
from mlx_spec.loading.loader import LoadedModel
from mlx_spec.loading.pairing import ModelPair
from mlx_spec.apps.runner import build_engine, gamma_policy
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.apps.stream import encode_prompt, stream_generate
target = LoadedModel(model, tokenizer, config, "default", path, "embedded")
pair = ModelPair(target, None, tokenizer, int(model(mx.array([[2]])).shape[-1]), None)
engine = build_engine(pair)  # the default preset's n-gram drafter
ids = encode_prompt(tokenizer, "Hello", False)
policy = gamma_policy("auto", engine, context=len(ids))  # reads the cached cost curve
t4 = time.perf_counter()
text = "".join(r.text for r in stream_generate(engine, tokenizer, ids, SamplingParams(), gamma=policy,
                                               max_tokens=1))
t5 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "weights": t2 - t1, "tokenizer": t3 - t2,
                  "calibration read": t4 - t3, "first token": t5 - t4}))
"""


def timed(cmd: list[str], cwd: Path, env: dict, cpu: list | None = None) -> float:
    """Wall-clock seconds of `cmd`; with `cpu`, its CPU seconds (user + system) are appended
    there: on a shared machine they move less with the load than the wall clock does."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{done.stderr}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if cpu is not None:
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another checkout to compare (run from its root)")
    parser.add_argument("--first-runs", type=int, default=3, help="first runs, each from an empty cache")
    parser.add_argument("--out", default="startup")
    args = parser.parse_args()

    checkouts = {"after": ROOT} if args.before is None else {"before": args.before.resolve(), "after": ROOT}
    cache = Path(tempfile.mkdtemp(prefix="mlx-spec-startup-"))
    env = {**os.environ, "MLX_SPEC_CACHE": str(cache), "PYTHONPATH": ""}
    generate = [sys.executable, "-m", "mlx_spec.cli", "generate", "-n", "1", "Hello"]
    first_runs = {name: [] for name in checkouts}
    first_cpu = {name: [] for name in checkouts}
    load_before = uptime()
    for rep in range(args.first_runs):  # timed first runs, each from an empty cache, alternating
        for name, cwd in (checkouts.items() if rep % 2 == 0 else reversed(checkouts.items())):
            scratch = tempfile.mkdtemp(prefix="mlx-spec-first-")
            first_runs[name].append(timed(generate, cwd, {**env, "MLX_SPEC_CACHE": scratch}, first_cpu[name]))
            shutil.rmtree(scratch)  # ~1.6 GB: the import and its float32 copy
    load_after_first_runs = uptime()
    timed(generate, ROOT, env)  # fills the cache the later runs read (checkouts share its import)
    chat = [sys.executable, "-m", "mlx_spec.cli", "chat"]  # stdin at EOF: it leaves at its first prompt
    runs = {name: {"import": [], "help": [], "generate -n 1": [], "generate -n 1 cpu": [], "chat to its prompt": []}
            for name in checkouts}
    phases = {name: [] for name in checkouts}
    for rep in range(args.repeats):
        for name, cwd in (checkouts.items() if rep % 2 == 0 else reversed(checkouts.items())):
            runs[name]["import"].append(timed([sys.executable, "-c", "import mlx_spec.cli"], cwd, env))
            runs[name]["help"].append(timed([sys.executable, "-m", "mlx_spec.cli", "--help"], cwd, env))
            runs[name]["generate -n 1"].append(timed(generate, cwd, env, runs[name]["generate -n 1 cpu"]))
            runs[name]["chat to its prompt"].append(timed(chat, cwd, env))
            out = subprocess.run([sys.executable, "-c", PHASES], cwd=cwd, env=env, capture_output=True, text=True)
            phases[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {}
    for name in checkouts:
        medians = {k: median(v) for k, v in runs[name].items()}
        breakdown = {k: median([p[k] for p in phases[name]]) for k in phases[name][0]}
        first = median(first_runs[name])
        result[name] = {"wall_s_median": medians, "in_process_s_median": breakdown, "runs": runs[name],
                        "first_run_s": {"median": first, "runs": first_runs[name],
                                        "cpu_s_median": median(first_cpu[name]), "cpu_s_runs": first_cpu[name],
                                        "over_a_later_run": first - medians["generate -n 1"]}}
        print(f"{name}: first run {first:.1f} s ({first - medians['generate -n 1']:.1f} s more than a later one) · "
              + " · ".join(f"{k} {v:.2f} s" for k, v in medians.items())
              + " | in process: " + " · ".join(f"{k} {v:.2f} s" for k, v in breakdown.items()))
    path = write_results(args.out, {"repeats": args.repeats, "command": " ".join(generate[1:]),
                                    "checkouts": {k: str(v) for k, v in checkouts.items()},
                                    "load_before": load_before, "load_after_first_runs": load_after_first_runs,
                                    "load_after": uptime(), **result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
