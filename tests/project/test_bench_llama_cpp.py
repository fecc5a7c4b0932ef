"""bench/vs_llama_cpp.py's own helpers, without llama-cpp-python (the peer run itself needs it
and minutes of CPU: `python bench/vs_llama_cpp.py --max-tokens 16 --repeats 1` is its smoke check)."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "bench" / "vs_llama_cpp.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_llama_cpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_time_starts_at_the_first_hand_back(script):
    def chunks():
        time.sleep(0.2)  # "prompt processing"
        yield [1, 2]  # a first round of two tokens: both count as prompt time
        for token in range(3, 7):
            time.sleep(0.01)
            yield [token]

    result = script.timed_chunks(chunks())
    assert result["tokens"] == [1, 2, 3, 4, 5, 6]
    assert result["prompt_s"] >= 0.2
    assert 0.04 <= result["decode_s"] < 0.2  # the prompt's time is not in it
    assert result["decode_tps"] == pytest.approx(4 / result["decode_s"])


def test_first_difference(script):
    assert script.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert script.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert script.first_difference([1, 2], [1, 2, 3]) == 2


def test_the_script_does_not_shadow_the_package(script):
    """With bench/ on sys.path (as when it runs) the import must find llama-cpp-python
    (a script named llama_cpp.py there once shadowed it), or nothing."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        llama_cpp, lookup = script.import_llama_cpp()
    except ImportError:
        pytest.skip("llama-cpp-python is not installed")
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert Path(llama_cpp.__file__).resolve() != SCRIPT.resolve()
    assert hasattr(llama_cpp, "Llama") and lookup().num_pred_tokens > 0


def test_blas_is_described(script):
    info = script.mlx_blas()
    assert "libraries" in info and "mlx_uses" in info


@pytest.fixture
def other_load():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from common import OtherLoad
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return OtherLoad


def test_other_processes_cpu_is_the_machines_busy_time_less_this_ones(other_load, monkeypatch):
    """The quiet check behind the llama.cpp run, on given readings of (wall, machine busy,
    this process's CPU) seconds: 2 s in which the machine was busy 3 s, 1 s of it ours."""
    readings = iter([(100.0, 50.0, 7.0), (102.0, 53.0, 8.0)])
    monkeypatch.setattr(other_load, "_now", staticmethod(lambda: next(readings)))
    assert other_load().cores() == pytest.approx(1.0)


def test_a_busy_process_beside_counts_and_our_own_work_does_not(other_load):
    """The same on this machine's real /proc/stat, where a core is free to show it."""
    import subprocess

    if other_load().start is None:
        pytest.skip("no /proc/stat here")

    def measured(work, seconds=1.5):
        load = other_load()
        work(seconds)
        return load.cores()

    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    def beside(seconds=1.5):  # read before the spinner is waited for: then its time is ours
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            load = other_load()
            time.sleep(seconds)
            return load.cores()
        finally:
            spinner.kill()
            spinner.wait()

    idle = measured(time.sleep)
    if idle > (os.cpu_count() or 1) - 1.2:  # e.g. pytest-xdist's other worker on 2 cores
        pytest.skip(f"other processes take {idle:.2f} cores: no free core to see one more")
    assert measured(spin) < idle + 0.3  # our own CPU time is left out
    assert beside() > idle + 0.5  # another process's is counted
