"""Memory of a sharded load: MLX's peak while loading the embedded Gemma 3 270M (float32)
in one process, and on each of 2 ring ranks that keep half of every layer.

    python bench/shard_memory.py

Starts itself under `mlx.launch --backend ring -n 2`; writes bench/results/shard_memory_gemma270m.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx_spec  # noqa: F401,E402  (before mlx.core: it loads the optimised BLAS)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()",
          "--backend", "ring", "-n", "2", "--"]


def measure(group=None) -> dict:
    from mlx_spec.core.cost_model import weight_bytes
    from mlx_spec.loading import load_model

    mx.reset_peak_memory()
    loaded = load_model(None, dtype="float32", progress=False, group=group)
    return {"peak_bytes": mx.get_peak_memory(), "weight_bytes": weight_bytes(loaded.model)}


def main() -> None:
    if "--rank" in sys.argv:
        from mlx_spec.apps import distributed
        w = distributed.world()
        mine = measure(w.group)
        every = mx.distributed.all_gather(mx.array([[mine["peak_bytes"], mine["weight_bytes"]]], mx.float32),
                                          group=w.group)
        mx.eval(every)  # on every rank: a collective
        if w.is_root:
            print(json.dumps([{"peak_bytes": int(p), "weight_bytes": int(b)} for p, b in every.tolist()]))
        return
    single = measure()
    result = subprocess.run(LAUNCH + [sys.executable, __file__, "--rank"], capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        raise SystemExit(result.stderr[-3000:])
    ranks = json.loads(result.stdout.strip().splitlines()[-1])
    path = write_results("shard_memory_gemma270m", {"model": "Gemma 3 270M, float32", "one_process": single,
                                                    "two_ranks": ranks})
    print(f"one process: peak {single['peak_bytes'] / 1e9:.2f} GB, weights {single['weight_bytes'] / 1e9:.2f} GB; "
          + "; ".join(f"rank {i}: peak {r['peak_bytes'] / 1e9:.2f} GB, weights {r['weight_bytes'] / 1e9:.2f} GB"
                      for i, r in enumerate(ranks)) + f"; {path}")


if __name__ == "__main__":
    main()
