"""The terminal surface a new user meets (issue 20), through the real CLI: usage errors in
our one-line style, `models list` at ordinary widths, bench's prompt names and α̂ cells,
wording, and feedback before the first token."""

import pytest

from cli_support import invoke

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")


# ---------------------------------------------------------------------------------------
# Usage errors: one line naming the flag, exit 2, the same `error: ...` style as ours
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,named,command", [
    (["generate", "x", "--temp", "-1"], "--temp", "mlx-spec generate"),
    (["generate", "x", "-n", "0"], "--max-tokens", "mlx-spec generate"),
    (["generate", "x", "--bogus"], "--bogus", "mlx-spec generate"),
    (["generate", "x", "--temp"], "--temp", "mlx-spec generate"),  # value missing
    (["generate", "x", "y"], "(y)", "mlx-spec generate"),
    (["bench", "--runs", "abc"], "--runs", "mlx-spec bench"),
    (["serve", "--port", "http"], "--port", "mlx-spec serve"),
    (["models", "info"], "'source'", "mlx-spec models info"),
    (["models", "nosuch"], "'nosuch'", "mlx-spec models"),
    (["nosuch"], "'nosuch'", "mlx-spec"),
    (["--bogus"], "--bogus", "mlx-spec"),
])
def test_usage_errors_are_one_line_naming_the_flag_and_exit_2(args, named, command):
    result = invoke(args)
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and named in lines[0], lines[0]
    assert lines[0].endswith(f"(see '{command} --help')"), lines[0]
    assert "Usage:" not in result.stderr and "╭" not in result.stderr and "Traceback" not in result.stderr


def test_our_errors_are_one_line_with_a_short_debug_hint():
    result = invoke(["generate", "x", "-m", "./no/such/model"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: target model: no such file or folder: ./no/such/model (--debug for the traceback)"]


def test_usage_error_in_a_real_process():
    """The console script as a user runs it (Typer's own handler would box the error)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("mlx-spec")
    run = subprocess.run([str(script), "generate", "x", "--temp", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: invalid value for --temp: input should be greater than or equal to 0 "
        "(see 'mlx-spec generate --help')"]


# ---------------------------------------------------------------------------------------
# models list on an ordinary terminal
# ---------------------------------------------------------------------------------------

def _terminal_list(width: int) -> list[str]:
    """`models list` as a terminal of `width` columns shows it (Rich reads COLUMNS), as text."""
    from cli_support import ANSI
    from typer.testing import CliRunner

    from mlx_spec.cli import app

    result = CliRunner().invoke(app, ["models", "list"],
                                env={"COLUMNS": str(width), "TTY_COMPATIBLE": "1", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return ANSI.sub("", result.stdout).splitlines()


@pytest.mark.parametrize("width", [80, 120, 50, 220])
def test_models_list_never_cuts_a_name_and_keeps_the_key_columns(width):
    from mlx_spec.models.presets import list_presets

    lines = _terminal_list(width)
    assert max(len(line) for line in lines) <= width
    words = [line.split() for line in lines]
    for preset in list_presets():
        if width >= 80:  # a table: the preset's row starts with its whole name, then drafter and γ
            row = next((w for w in words if w and w[0] == preset.name), None)
            assert row is not None, (preset.name, lines)
            assert preset.drafter in row and str(preset.gamma) in row, row
        else:  # one block per preset, titled with its whole name (a long id may fold)
            assert [preset.name] in words, (preset.name, lines)
            continue
        for model_id in (preset.target, preset.draft):
            if model_id:
                assert any(model_id in w for w in words), (model_id, lines)
    header = words[next(i for i, line in enumerate(lines) if "drafter" in line)] if width >= 80 else []
    if width >= 80:
        assert {"name", "drafter", "γ", "target"} <= set(header), header
        assert "draft" in header or "/" in header  # target and draft stacked in one column
