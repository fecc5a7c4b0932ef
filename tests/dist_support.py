"""Helpers for the distributed tests: start ranks on localhost over the ring backend, and a
tiny Gemma 4 shaped for sharding."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RANK_SCRIPT = HERE / "dist_rank.py"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ring_env(rank: int, hostfile: Path) -> dict:
    env = dict(os.environ)
    env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
    return env


def write_hostfile(path: Path, n: int) -> Path:
    """A ring hostfile for n ranks on this machine (what mlx.launch writes for -n n)."""
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    return path


def spawn_ranks(argv_per_rank: list[list[str]], tmp: Path, *, stdin=None, timeout: float = 120,
                cwd: Path | None = None) -> list[subprocess.CompletedProcess]:
    """Start one process per argv (rank i gets argv i) as mlx.launch would, wait for all
    (killing every rank at `timeout`), and return their results (stdout/stderr text).

    `stdin` (text) goes to rank 0 only, as with launchers that do not forward input."""
    hostfile = write_hostfile(tmp / "hosts.json", len(argv_per_rank))
    procs = []
    for rank, argv in enumerate(argv_per_rank):
        procs.append(subprocess.Popen(
            argv, env=ring_env(rank, hostfile), cwd=cwd, text=True,
            stdin=subprocess.PIPE if (rank == 0 and stdin is not None) else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    if stdin is not None:
        procs[0].stdin.write(stdin)
        procs[0].stdin.close()
        procs[0].stdin = None  # written: communicate() must not flush it again
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def run_rank_script(mode: str, tmp: Path, *args: str, n: int = 2, timeout: float = 120) -> list[dict]:
    """Run tests/dist_rank.py MODE on n ranks; each writes tmp/MODE-<rank>.json, returned in
    rank order. A rank that fails fails the test with its stderr."""
    results = spawn_ranks([[sys.executable, str(RANK_SCRIPT), mode, str(tmp), *args]] * n, tmp,
                          timeout=timeout)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stderr[-3000:]}"
    return [json.loads((tmp / f"{mode}-{rank}.json").read_text()) for rank in range(n)]


def tiny_gemma4_tp(seed: int = 0, moe: bool = False, **overrides):
    """`models.tiny_gemma4` with what sharding has to get right: 4 query heads, sliding
    layers with 2 kv heads (split over 2 ranks), full layers with 1 kv head serving as both
    k and v (replicated), the KV-shared layers, and optionally MoE experts."""
    from mlx_spec.testing.tiny_gemma4 import tiny_gemma4

    config = dict(num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1,
                  attention_k_eq_v=True)
    if moe:
        config.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return tiny_gemma4(seed=seed, **{**config, **overrides})
