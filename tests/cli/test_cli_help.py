"""Every command's `--help` as a person reads it in an 80-column terminal (issue 45, item 11):
no Typer type names (`<bool>`, `<float range>`, `<list[str]>`, ...), no text cut off with "…",
and every flag and value name whole on one line."""

import re

import pytest
import typer.main
from typer.testing import CliRunner

from mlx_spec.cli import app

COLUMNS = 80


def command_paths():
    """[[], ["generate"], ["models", "list"], ...]: every command and group of the app."""
    paths = [[]]

    def walk(group, path):
        for name, command in group.commands.items():
            paths.append([*path, name])
            if hasattr(command, "commands"):
                walk(command, [*path, name])

    walk(typer.main.get_command(app), [])
    return paths


def command_at(path):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def help_text(path) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(COLUMNS), "TERM": "dumb"},
                                terminal_width=COLUMNS)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path", command_paths(), ids=lambda p: " ".join(p) or "mlx-spec")
def test_help_reads_at_80_columns(path):
    text = help_text(path)
    assert max(len(line) for line in text.splitlines()) <= COLUMNS
    type_names = re.findall(r"<(?:bool|str|int|float|text|integer|path|list\[\w+\]|\w+ range)>|float range|int range"
                            r"|list\[str\]", text, flags=re.IGNORECASE)
    assert not type_names, type_names
    assert "…" not in text, [line for line in text.splitlines() if "…" in line]
    lines = text.splitlines()
    for param in command_at(path).params:
        if getattr(param, "hidden", False):
            continue
        names = [*param.opts, *param.secondary_opts] if param.param_type_name == "option" else []
        if param.metavar:
            names.append(param.metavar)
        for name in names:  # whole on one line: not folded mid-word across two
            assert any(name in line for line in lines), (name, text)
