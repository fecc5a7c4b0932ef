"""Speculation over a tensor-parallel target: `mlx-spec bench` in one process, then the
same sweep across 2 ring ranks on this machine (`mlx.launch --backend ring -n 2`), with the
draft model on rank 0 (tokens broadcast) and, where there is one, on every rank.

    python bench/distributed.py --pair gemma270m-ngram --prompt quote --gammas 1,3 --max-tokens 32
    python bench/distributed.py --pair tiny --prompt long --gammas 1,3 --max-tokens 48

Each sweep interleaves its settings and reports warm medians; the speedups compared are
each sweep's own (a setting over drafting off in the same run). Writes
bench/results/distributed_<pair>_<prompt>.json.

Both ranks share this machine's cores, and MLX's ring backend busy-waits for its peer, so
a rank waiting in an all-reduce takes CPU from the rank still computing: absolute speeds
here say nothing about two Macs; the ratios say how much of the per-forward cost is
communication and how much of it a γ+1-wide verify amortises.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

CLI = [sys.executable, "-m", "mlx_spec.cli"]
LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()",
          "--backend", "ring", "-n", "2", "--"]


def pair_args(name: str, folder: Path) -> list[str]:
    if name == "gemma270m-ngram":  # the default preset: float32 270M, prompt-lookup drafts
        return ["-m", "default", "--drafter", "ngram", "--dtype", "float32"]
    if name == "tiny":  # tiny random Gemma 3, a perturbed copy drafting (4 heads, 2 kv heads)
        from mlx_spec.testing.tiny import perturbed_copy, save_tiny_model, tiny_gemma3

        target = tiny_gemma3(seed=0, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8)
        save_tiny_model(folder / "target", target)
        save_tiny_model(folder / "draft", perturbed_copy(target, noise=0.02, seed=1))
        return ["-m", str(folder / "target"), "-d", str(folder / "draft")]
    raise SystemExit(f"unknown pair {name!r}")


def run(argv: list[str]) -> dict:
    print("+", " ".join(argv[-12:]), file=sys.stderr, flush=True)
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(f"failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="gemma270m-ngram", choices=["gemma270m-ngram", "tiny"])
    parser.add_argument("--prompt", default="quote")
    parser.add_argument("--gammas", default="1,3")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sweep = ["bench", *pair_args(args.pair, tmp), "--gamma", args.gammas, "--prompt", args.prompt,
                 "--max-tokens", str(args.max_tokens), "--runs", str(args.runs), "--json"]
        single = run(CLI + sweep)
        (tmp / "single.json").write_text(json.dumps(single))
        placements = ["root", "all"] if args.pair != "gemma270m-ngram" else ["root"]
        tp = {on: run(LAUNCH + CLI + sweep + ["--compare", str(tmp / "single.json"), "--draft-on", on])
              for on in placements}

    rows = []
    for s in single["settings"]:
        row = {"setting": s["setting"], "one_process": {"decode_tps": s["decode_tps"], "speedup": s["speedup"],
                                                        "acceptance_rate": s["acceptance_rate"]}}
        for on, result in tp.items():
            t = next(x for x in result["settings"] if x["setting"] == s["setting"])
            row[f"two_ranks_draft_on_{on}"] = {
                k: t[k] for k in ("decode_tps", "speedup", "acceptance_rate", "all_reduces_per_round",
                                  "comm_time_per_round", "comm_share", "md5")}
        rows.append(row)
    identical = all(r["ok"] for r in [single, *tp.values()]) and len(
        {s["md5"] for r in [single, *tp.values()] for s in r["settings"]}) == 1
    name = f"distributed_{args.pair}_{args.prompt}"
    payload = {
        "pair": args.pair, "prompt": args.prompt, "max_tokens": args.max_tokens, "runs": args.runs,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "outputs_identical": identical, "settings": rows,
        "tensor_parallel": {on: r["tensor_parallel"] for on, r in tp.items()},
        "costs": {"one_process": single["costs"], **{f"two_ranks_{on}": r["costs"] for on, r in tp.items()}},
        "raw": {"one_process": single, **{f"two_ranks_{on}": r for on, r in tp.items()}},
    }
    path = write_results(name, payload)
    print(f"{'setting':8} {'1 proc tok/s':>12} {'speedup':>8} " + " ".join(
        f"{'2 ranks (' + on + ') tok/s':>22} {'speedup':>8} {'comm share':>10}" for on in tp))
    for r in rows:
        line = f"{r['setting']:8} {r['one_process']['decode_tps']:12.1f} {r['one_process']['speedup']:7.2f}x "
        for on in tp:
            t = r[f"two_ranks_draft_on_{on}"]
            line += f"{t['decode_tps']:22.1f} {t['speedup']:7.2f}x {t['comm_share']:10.0%}"
        print(line)
    print(f"outputs identical: {identical}; results: {path}")
    print(json.dumps({"name": name, "outputs_identical": identical}))


if __name__ == "__main__":
    main()
