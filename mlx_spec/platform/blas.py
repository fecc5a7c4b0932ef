"""The BLAS that MLX's CPU backend computes float32 matmuls with, chosen before mlx.core loads.

The `mlx[cpu]` Linux wheel bundles the netlib reference BLAS: its `cblas_sgemm` is a naive
loop, so a verify of k rows costs about k single steps and speculation cannot pay. A
library loaded with RTLD_GLOBAL before `mlx.core` wins the symbol lookup of `libmlx.so`
(its bundled BLAS sits in its local scope, searched after the global one), so mlx-spec
loads an optimised BLAS first, with no LD_PRELOAD for the user to set:

    auto       MKL from PyPI (`mkl`, x86-64, a dependency there), else a system OpenBLAS
               (Debian/Ubuntu `libopenblas0`), else the wheel's reference BLAS
    mkl | openblas | reference | /path/to/libblas.so     forced, by $MLX_SPEC_BLAS

Threads: half the cores (`default_threads`), and for a forward of `WIDE_ROWS` rows or more (a
prefill chunk, a batch's widest verify) every core other processes leave free
(`wide_threads`, `free_cores`); or $MLX_SPEC_BLAS_THREADS
for both, or the library's own variable (MKL_NUM_THREADS, OPENBLAS_NUM_THREADS,
OMP_NUM_THREADS) where one is set.

PyPI's `scipy-openblas32` cannot serve: it prefixes its symbols (`scipy_cblas_sgemm`).
Nothing is loaded on macOS (MLX uses Accelerate) or beside a CUDA build of MLX.
`mlx_spec.runtime.install()` calls `load()` from `mlx_spec/__init__.py`, so any `import mlx_spec...`
comes first.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import site
import sys
import time
from contextlib import contextmanager
from typing import Optional

ENV = "MLX_SPEC_BLAS"
CHOICES = ("auto", "mkl", "openblas", "reference")

_state: Optional[dict] = None  # what load() did, for describe()


def _mkl_paths() -> list[str]:
    """libmkl_rt from the `mkl` wheel: pip puts its libraries in <prefix>/lib."""
    roots = {sys.prefix, sys.base_prefix, site.getuserbase()}
    found = []
    for root in roots:
        found += sorted(glob.glob(os.path.join(root, "lib", "libmkl_rt.so.*")), reverse=True)
    return found


def _openblas_paths() -> list[str]:
    arch = f"{platform.machine()}-linux-gnu"
    return [p for p in (f"/usr/lib/{arch}/libopenblas.so.0", "/usr/lib64/libopenblas.so.0",
                        "/usr/lib/libopenblas.so.0", f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0")
            if os.path.exists(p)]


def _kind(path: str) -> str:
    name = os.path.basename(path)
    return "mkl" if "mkl" in name else "openblas" if "openblas" in name else "custom"


def _skip_reason() -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return "Accelerate" if sys.platform == "darwin" else "MLX's own"
    try:
        from importlib.util import find_spec

        # A CUDA build computes on the GPU; its CPU side is left as shipped.
        if any(find_spec(name) is not None for name in ("mlx_cuda", "mlx_cuda_13")):
            return "MLX's own (CUDA build)"
    except (ImportError, ValueError):
        pass
    return None


def load() -> dict:
    """Load the chosen BLAS globally, once, before `mlx.core`; never raises. Returns the
    state `describe()` reports (thread count and version are added there, on first use)."""
    global _state
    if _state is not None:
        return _state
    wanted = os.environ.get(ENV, "auto").strip() or "auto"
    state = {"requested": wanted, "name": "reference", "path": None, "problem": None}
    skip = _skip_reason()
    if skip is not None:
        state["name"] = skip
    elif "mlx.core" in sys.modules:
        state["name"] = "unknown"
        state["problem"] = "mlx.core was imported before mlx_spec, so the BLAS was not chosen"
    elif wanted != "reference":
        if wanted == "auto":
            candidates = _mkl_paths() + _openblas_paths()
        elif wanted == "mkl":
            candidates = _mkl_paths()
        elif wanted == "openblas":
            candidates = _openblas_paths()
        elif os.sep in wanted or wanted.startswith("lib"):
            candidates = [wanted]
        else:
            candidates = []
        if not candidates and wanted != "auto":
            state["problem"] = (f"{ENV}={wanted}: no such BLAS found" if wanted in CHOICES
                                else f"{ENV} must be one of {', '.join(CHOICES)} or a library path, not {wanted!r}")
        for path in candidates:
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as err:
                state["problem"] = f"{ENV}={wanted}: cannot load {path} ({err})"
                continue
            state.update(name=_kind(path), path=path, problem=None)
            _set_threads(lib, state["name"])
            _keep_setter(lib, state["name"])
            break
    _state = state
    return state


THREADS_ENV = "MLX_SPEC_BLAS_THREADS"


def default_threads() -> int:
    """Half the cores, at least one. MLX's own work (attention, norms, sampling) runs beside
    the BLAS, and a BLAS thread that waits for a busy core costs more than it brings: on
    our 2-core CPU MKL's 640 × 262144 matmul took 34 / 36 ms on 1 / 2 threads idle, and
    42 / 54 ms with both cores busy elsewhere (bench/blas_matmul.py)."""
    return max(1, (os.cpu_count() or 1) // 2)


WIDE_ROWS = 16  # from this many rows a forward runs on every free core (`wide_threads`)
_setter = None  # the library's set-threads call, while threads are ours to choose
_narrow = _wide = 1


def wide_threads() -> int:
    """Every core. A matmul over many rows is compute-bound and a second thread nearly halves
    it, where one over a few rows waits on memory either way. On our 2-core CPU, MKL's
    640 × 262144 matmul (bench/blas_matmul.py) on 1 / 2 threads: 1 row 37 / 35 ms, 16 rows
    119 / 105, 64 rows 434 / 225 idle; beside a process keeping one core busy 16 rows
    137 / 173 and 64 rows 402 / 410. So from `WIDE_ROWS` rows on (prefill chunks; a batch's
    verifies), not below, and only on cores other processes leave free (`free_cores`). End
    to end, 4 clients decoded together at auto γ, quiet (bench/wide_rows.py): from 16 rows
    1.18× (copying prompts) and 1.15× (ordinary) the aggregate tok/s of from 32; from 8
    1.18× / 1.12×, from 4 1.09× / 1.09×."""
    return max(1, os.cpu_count() or 1)


_OWN_ENV = {"mkl": "MKL_NUM_THREADS", "openblas": "OPENBLAS_NUM_THREADS"}  # the library's own variable


def _library_count_set(kind: str) -> bool:
    """Whether the user set the library's own thread count (its variable, or OpenMP's)."""
    return _OWN_ENV[kind] in os.environ or "OMP_NUM_THREADS" in os.environ


def _thread_setter(lib, kind: str):
    return getattr(lib, "MKL_Set_Num_Threads" if kind == "mkl" else "openblas_set_num_threads", None)


def _keep_setter(lib, kind: str) -> None:
    global _setter, _narrow, _wide
    if kind not in _OWN_ENV or THREADS_ENV in os.environ or _library_count_set(kind):
        return  # one count for every matmul: the user's
    _narrow, _wide = default_threads(), wide_threads()
    if _wide != _narrow:
        _setter = _thread_setter(lib, kind)


class OtherLoad:
    """How much CPU the machine's other processes use, in cores: the machine's busy time
    (/proc/stat) minus this process's own CPU time (all its threads, and waited-for
    children), over wall-clock time since this was made. The load average cannot tell: it
    counts our own threads too. None where /proc/stat is missing (macOS)."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now():
        try:
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return time.monotonic(), busy, own.user + own.system + own.children_user + own.children_system

    def seconds(self) -> float:
        return 0.0 if self.start is None else time.monotonic() - self.start[0]

    def cores(self) -> Optional[float]:
        """Others' mean cores since this was made."""
        now = self._now()
        if now is None or self.start is None or now[0] <= self.start[0]:
            return None
        wall, busy, own = (a - b for a, b in zip(now, self.start))
        return max(0.0, (busy - own) / wall)


_load: Optional[OtherLoad] = None  # since the last reading of others' load
_others = 0.0  # others' cores at the last reading (none before the first)


def free_cores() -> int:
    """Cores other processes left us over the last second or more (`OtherLoad`): a BLAS
    thread that waits for a busy core costs more than it brings (16 rows beside a busy
    core, above)."""
    global _load, _others
    if _load is None or _load.seconds() >= 1.0:
        others = None if _load is None else _load.cores()
        _others = _others if others is None else others
        _load = OtherLoad()
    return int(_wide - _others + 0.5)


@contextmanager
def threads_for(rows: int):
    """BLAS threads for a forward over `rows` rows, evaluated inside the block: from
    WIDE_ROWS rows on, every core that other processes leave free (at least the default);
    below, the default."""
    threads = max(_narrow, min(_wide, free_cores())) if _setter is not None and rows >= WIDE_ROWS else _narrow
    if threads == _narrow:
        yield
        return
    _setter(threads)
    try:
        yield
    finally:
        _setter(_narrow)


def threads_label() -> str:
    """'1', or '1/2@16' where forwards of 16 rows or more use more threads (for cost-curve
    keys: a curve measured under another threshold priced its widths on other threads)."""
    threads = describe()["threads"]
    return f"{threads}/{_wide}@{WIDE_ROWS}" if _setter is not None and threads else str(threads or "")


def _set_threads(lib, kind: str) -> None:
    """Our thread count, unless the user chose one ($MLX_SPEC_BLAS_THREADS, or the
    library's own MKL_NUM_THREADS / OPENBLAS_NUM_THREADS / OMP_NUM_THREADS)."""
    if kind not in _OWN_ENV or (THREADS_ENV not in os.environ and _library_count_set(kind)):
        return
    try:
        threads = max(1, int(os.environ.get(THREADS_ENV, default_threads())))
        _thread_setter(lib, kind)(threads)
    except (ValueError, TypeError, OSError):  # a bad count, or no such call (TypeError: None)
        pass


def _library_facts(state: dict) -> tuple[Optional[int], Optional[str]]:
    """(threads, version) from the loaded library's own calls."""
    if state["path"] is None:
        return (1, None) if state["name"] == "reference" else (None, None)
    try:
        lib = ctypes.CDLL(state["path"])
        if state["name"] == "mkl":
            buf = ctypes.create_string_buffer(256)
            lib.MKL_Get_Version_String(buf, len(buf))
            version = buf.value.decode(errors="replace").split("-Product")[0]
            return int(lib.mkl_get_max_threads()), version.replace("Intel(R) oneAPI Math Kernel Library ", "MKL ")
        if state["name"] == "openblas":
            lib.openblas_get_config.restype = ctypes.c_char_p
            return int(lib.openblas_get_num_threads()), lib.openblas_get_config().decode(errors="replace")
    except (OSError, AttributeError, ValueError):
        pass
    return None, None


def describe() -> dict:
    """{"name": "mkl" | "openblas" | "reference" | "custom" | "Accelerate" | ..., "path",
    "threads", "version", "requested", "problem"}: JSON-ready, for --version, --json and bench.
    The library is asked once (on first use, not at import: its calls start its runtime)."""
    state = load()
    if "threads" not in state:
        state["threads"], state["version"] = _library_facts(state)
    return dict(state)


def threads_reason() -> str | None:
    """Why the BLAS runs on the threads it does, for a person reading `summary()`: who set
    the count, or the default's rule (half the cores; all that are free from `WIDE_ROWS` rows)."""
    info = describe()
    if not info["threads"] or info["name"] not in _OWN_ENV:
        return None
    if THREADS_ENV in os.environ:
        return f"set by ${THREADS_ENV}"
    for variable in (_OWN_ENV[info["name"]], "OMP_NUM_THREADS"):
        if variable in os.environ:
            return f"set by ${variable}"
    cores = os.cpu_count() or 1
    rule = f"half of the {cores} cores" if cores > 1 else "the one core"
    if _setter is not None:
        rule += f"; forwards of {WIDE_ROWS}+ rows use every free core, up to {_wide}"
    return rule


def summary() -> str:
    """One line: 'mkl (MKL Version 2026.2, 1 thread: half of the 2 cores; forwards of 16+ rows
    use every free core, up to 2)'."""
    info = describe()
    threads = None
    if info["threads"]:
        threads = f"{info['threads']} thread{'s' * (info['threads'] != 1)}"
        if (reason := threads_reason()) is not None:
            threads += f": {reason}"
    details = [d for d in (info["version"], threads) if d]
    return info["name"] + (f" ({', '.join(details)})" if details else "")
