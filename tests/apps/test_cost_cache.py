"""The cost-curve cache (`costs.json`) is shared by every mlx-spec process of a user: a
server, a `generate` and a `bench` may calibrate at once, and each reads, changes and
writes the whole table. Under the lock none loses another's curve; without it (the control
run, with the lock replaced by a no-op) curves are lost, so the test can tell."""

import json
import subprocess
import sys

from mlx_spec.apps.calibration import store_curve

WRITERS, CURVES = 4, 25
WRITER = """
import contextlib, sys
from pathlib import Path
import filelock
if sys.argv[3] == "unlocked":
    filelock.FileLock = lambda *args, **kwargs: contextlib.nullcontext()
from mlx_spec.apps.calibration import store_curve
for i in range({curves}):
    store_curve(Path(sys.argv[1]), f"writer{{sys.argv[2]}}-curve{{i}}", {{"verify": [0.1] * 7, "measured_at": 0}})
""".format(curves=CURVES)


def run_writers(path, mode: str) -> set:
    """The keys the table holds after the writers ran (none if they left it damaged)."""
    # A table of a few thousand curves makes each write take milliseconds, as a user's does.
    path.write_text(json.dumps({f"old{i}": {"verify": [0.1] * 7} for i in range(3000)}))
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), mode]) for w in range(WRITERS)]
    assert all(p.wait(120) == 0 for p in writers)
    try:
        return set(json.loads(path.read_text()))
    except ValueError:
        return set()


def test_concurrent_calibrations_keep_every_curve(tmp_path):
    every = {f"old{i}" for i in range(3000)} | {f"writer{w}-curve{i}" for w in range(WRITERS) for i in range(CURVES)}
    assert run_writers(tmp_path / "costs.json", "locked") == every
    assert run_writers(tmp_path / "control.json", "unlocked") < every  # without the lock the race loses curves


def test_a_damaged_table_is_replaced(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text("[1, 2")
    store_curve(path, "k", {"verify": [1.0]})
    assert json.loads(path.read_text()) == {"k": {"verify": [1.0]}}
