"""Every bench script loads mlx_spec before MLX: mlx_spec chooses the BLAS (MKL on Linux)
before `mlx.core` loads, and a script that imports MLX first measures under the reference
BLAS instead (structured.json was measured that way: blas 'unknown', steps ~2x slower)."""

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
# Local modules that import mlx_spec (or common, which does) before anything of MLX.
LOADS_MLX_SPEC_FIRST = {"mlx_spec", "common"}
MLX = {"mlx", "mlx_lm", "mlx_vlm"}


def _top_level_imports(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return names


def _loads_mlx_before_mlx_spec(path: Path) -> bool:
    for name in _top_level_imports(path):
        if name in LOADS_MLX_SPEC_FIRST:
            return False
        if name in MLX:
            return True
    return False


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_bench_script_imports_mlx_spec_before_mlx(script):
    assert not _loads_mlx_before_mlx_spec(script), (
        f"{script.name} imports MLX before mlx_spec, so the BLAS is not chosen")


def test_the_check_sees_mlx_first(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport mlx.core as mx\nfrom common import median\n")
    good = tmp_path / "good.py"
    good.write_text("import sys\nfrom common import median\nimport mlx.core as mx\n")
    assert _loads_mlx_before_mlx_spec(bad) and not _loads_mlx_before_mlx_spec(good)
