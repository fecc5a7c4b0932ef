"""Helpers for the CLI tests around Typer's CliRunner (fixtures live in cli_fixtures.py)."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from mlx_spec.cli import app

ESC = "\x1b"
# Control sequences we could emit (colours, cursor moves). Random tiny models can emit a bare
# ESC byte as text, so tests look for whole sequences.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def has_ansi(text: str) -> bool:
    return bool(ANSI.search(text))


def invoke(args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def invoke_json(args, input=None) -> dict:
    result = invoke(list(args) + ["--json"], input=input)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return json.loads(result.stdout)


def assert_one_line_error(result, *fragments):
    """Exit code 1, one 'error: ...' line plus the debug hint, no traceback."""
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_usage_error(result, *fragments):
    """Exit code 2, one 'error: ...' line that ends by pointing at the command's --help,
    no traceback: a flag value refused by our own checks reads as one Click refuses."""
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(r" \(see '\S+( \S+)* --help'\)$", lines[0]), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def terminal_env() -> dict:
    """The environment for a pseudo-terminal child: its size comes from the terminal, not
    from COLUMNS/LINES that a test runner may have set."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "TERM")}
    env["TERM"] = "xterm-256color"
    return env
