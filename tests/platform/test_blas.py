"""The BLAS under MLX's CPU matmuls: chosen before mlx.core loads, used by MLX, overridable,
and reported. Each check runs in a fresh interpreter, since the choice is made at import."""

import json
import os
import platform
import subprocess
import sys
import time

import mlx.core as mx
import pytest

from mlx_spec.platform import blas
LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
HAS_MKL = bool(blas._mkl_paths())

PROBE = r"""
import json, numpy as np
import mlx_spec, mlx.core as mx
from mlx_spec.platform import blas
rng = np.random.default_rng(0)
w, x = rng.standard_normal((512, 640), dtype=np.float32), rng.standard_normal((8, 640), dtype=np.float32)
y = np.array(mx.array(x) @ mx.array(w).T)
exact = x.astype(np.float64) @ w.T.astype(np.float64)
mapped = sorted({line.split("/")[-1].strip() for line in open("/proc/self/maps") if ".so" in line})
print(json.dumps({"blas": blas.describe(), "error": float(np.max(np.abs(y - exact)) / np.max(np.abs(exact))),
                  "mapped": mapped}))
"""


def probe(env_value=None):
    env = {k: v for k, v in os.environ.items() if k != blas.ENV}
    if env_value is not None:
        env[blas.ENV] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not (LINUX_X86 and HAS_MKL), reason="MKL ships from PyPI for x86-64 Linux only")
def test_mkl_computes_mlx_float32_matmuls_by_default():
    out = probe()
    assert out["blas"]["name"] == "mkl" and out["blas"]["threads"] >= 1 and out["blas"]["version"]
    # MKL loads its compute kernels on its first call: so MLX's sgemm went through MKL
    assert any(name.startswith("libmkl_core") for name in out["mapped"])
    assert out["error"] < 1e-5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reference BLAS is the Linux wheel's")
def test_reference_on_request_loads_no_other_blas():
    out = probe("reference")
    assert out["blas"]["name"] == "reference" and out["blas"]["problem"] is None
    assert not any(name.startswith(("libmkl", "libopenblas")) for name in out["mapped"])  # numpy has its own, prefixed
    assert out["error"] < 1e-5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_a_bad_choice_is_reported_and_the_cli_refuses_it_in_one_line():
    out = probe("nosuch")
    assert out["blas"]["name"] == "reference" and "must be one of" in out["blas"]["problem"]
    env = {**os.environ, blas.ENV: "/nowhere/libblas.so"}
    done = subprocess.run([sys.executable, "-m", "mlx_spec.cli", "models", "list"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "cannot load" in done.stderr


def test_version_names_mlx_spec_mlx_mlx_lm_device_and_blas():
    from typer.testing import CliRunner

    from mlx_spec.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == ["mlx-spec", "mlx", "mlx-lm", "device", "BLAS"]
    assert blas.describe()["name"] in lines[-1]


def test_the_suite_runs_under_the_blas_it_asked_for():
    """CI installs the README's test command: on x86-64 Linux that brings MKL, and the
    suite (conftest imports mlx_spec first) must be running under it; with $MLX_SPEC_BLAS
    set, under the one it names (or with the problem reported)."""
    info = blas.describe()
    requested = os.environ.get(blas.ENV, "auto").strip() or "auto"
    assert info["requested"] == requested, info
    if requested != "auto":  # a kind, or a library's path
        assert requested in (info["name"], info["path"]) or info["problem"], info
    elif LINUX_X86:
        assert HAS_MKL, "the README's install brings MKL on x86-64 Linux"
        assert info["name"] == "mkl", info
    else:
        pytest.skip("no BLAS to load here: MLX's own (Accelerate on a Mac)")


@pytest.mark.skipif(not (LINUX_X86 and HAS_MKL), reason="MKL ships from PyPI for x86-64 Linux only")
def test_threads_default_to_half_the_cores_and_follow_the_users_choice():
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", blas.THREADS_ENV)}
    code = "import json, mlx_spec; from mlx_spec.platform import blas; print(json.dumps(blas.describe()))"

    def threads(**extra):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["threads"]

    assert threads() == blas.default_threads() == max(1, os.cpu_count() // 2)
    every = str(os.cpu_count())  # MKL caps its threads at the cores it finds
    assert threads(MLX_SPEC_BLAS_THREADS=every) == os.cpu_count()
    assert threads(MKL_NUM_THREADS=every) == os.cpu_count()  # the library's own variable, left alone


@pytest.mark.skipif(not (LINUX_X86 and HAS_MKL), reason="MKL ships from PyPI for x86-64 Linux only")
def test_the_blas_line_says_why_it_runs_on_so_many_threads():
    """Issue 45: `bench` said "BLAS mkl (…, 1 thread)" on a 2-core machine without a reason."""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", blas.THREADS_ENV)}
    code = "import mlx_spec; from mlx_spec.platform import blas; print(blas.summary())"

    def summary(**extra):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    cores, half = os.cpu_count(), max(1, os.cpu_count() // 2)
    line = summary()
    assert f"{half} thread{'s' * (half != 1)}: half of the {cores} cores" in line or cores == 1, line
    if cores > half:
        assert f"forwards of {blas.WIDE_ROWS}+ rows use every free core, up to {cores}" in line, line
    assert summary(MLX_SPEC_BLAS_THREADS="1").endswith("1 thread: set by $MLX_SPEC_BLAS_THREADS)")
    assert summary(MKL_NUM_THREADS="1").endswith("1 thread: set by $MKL_NUM_THREADS)")


@pytest.mark.skipif(not (LINUX_X86 and HAS_MKL), reason="MKL ships from PyPI for x86-64 Linux only")
def test_wide_forwards_run_on_every_core_and_the_users_count_is_kept():
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", blas.THREADS_ENV)}
    code = (
        "import ctypes, json, os, mlx_spec; from mlx_spec.platform import blas\n"
        "blas.free_cores = lambda: blas.wide_threads()  # whatever else runs here meanwhile\n"
        "lib = ctypes.CDLL(blas.describe()['path']); now = lambda: int(lib.mkl_get_max_threads())\n"
        "seen = {'before': now()}\n"
        "with blas.threads_for(blas.WIDE_ROWS - 1): seen['narrow'] = now()\n"
        "with blas.threads_for(blas.WIDE_ROWS): seen['wide'] = now()\n"
        "seen['after'] = now(); seen['label'] = blas.threads_label(); print(json.dumps(seen))"
    )

    def threads(**extra):
        done = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    cores, half = os.cpu_count(), max(1, os.cpu_count() // 2)
    label = f"{half}/{cores}@{blas.WIDE_ROWS}" if cores != half else str(half)
    assert threads() == {"before": half, "narrow": half, "wide": cores, "after": half, "label": label}
    assert threads(MLX_SPEC_BLAS_THREADS="1") == {"before": 1, "narrow": 1, "wide": 1, "after": 1, "label": "1"}
    assert threads(MKL_NUM_THREADS="1")["wide"] == 1


def test_prefill_chunks_and_batched_forwards_are_evaluated_on_the_wide_threads(tiny_target, monkeypatch):
    """Where a wide forward is evaluated, the BLAS runs on `wide_threads`; a decode step
    keeps the default (the switch is recorded, whatever this machine's BLAS)."""
    from mlx_spec.core.cache.sequence import SequenceCache
    from mlx_spec.core.passes import ModelPass, run_passes

    calls = []
    monkeypatch.setattr(blas, "_setter", calls.append)
    monkeypatch.setattr(blas, "_narrow", 1)
    monkeypatch.setattr(blas, "_wide", 2)
    monkeypatch.setattr(blas, "free_cores", lambda: 2)
    seq = SequenceCache(tiny_target, slack=8)
    seq.prefill(list(range(3, 3 + 2 * blas.WIDE_ROWS)), chunk_size=blas.WIDE_ROWS)
    assert calls == [2, 1, 2, 1]  # two chunks of WIDE_ROWS rows
    calls.clear()
    mx.eval(seq.forward(mx.array([5])))
    seq.settle([5])
    assert calls == []
    rows = [SequenceCache(tiny_target, slack=8) for _ in range(2)]
    for row in rows:
        row.prefill([3, 4, 5])
    calls.clear()
    half = blas.WIDE_ROWS // 2
    run_passes([ModelPass(row, mx.array([6] * half)) for row in rows])  # 2 × WIDE_ROWS/2 rows
    assert calls == [2, 1]


def test_wide_forwards_take_only_the_cores_other_processes_leave(monkeypatch):
    calls, others = [], [0.0]
    monkeypatch.setattr(blas, "_setter", calls.append)
    monkeypatch.setattr(blas, "_narrow", 2)
    monkeypatch.setattr(blas, "_wide", 4)
    monkeypatch.setattr(blas.OtherLoad, "cores", lambda self: others[0])
    monkeypatch.setattr(blas.OtherLoad, "seconds", lambda self: 1.0)  # a reading each time
    monkeypatch.setattr(blas, "_load", blas.OtherLoad())
    for load, threads in ((0.0, 4), (0.7, 3), (1.6, 2), (2.9, 2), (8.0, 2)):
        others[0] = load
        calls.clear()
        with blas.threads_for(blas.WIDE_ROWS):
            pass
        assert calls == ([threads, 2] if threads != 2 else []), load


def test_other_load_counts_another_processs_cpu():
    if blas.OtherLoad().start is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        theirs = blas.OtherLoad()
        time.sleep(1.5)
        assert theirs.cores() > 0.5  # a whole core busy elsewhere, at least half the time
    finally:
        spinner.kill()
        spinner.wait()
