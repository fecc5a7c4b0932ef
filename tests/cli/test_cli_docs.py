"""docs/cli.md is generated from the Typer app by scripts/cli_docs.py (issue 31): the committed
page must be what the app says now, and it must hold every command and flag --help shows."""

import importlib.util
import sys
from pathlib import Path

import typer.main

from mlx_spec.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cli_docs = _script()


def test_the_committed_cli_page_is_what_the_app_says():
    assert (ROOT / "docs" / "cli.md").read_text() == cli_docs.render(), \
        "docs/cli.md is out of date: run python scripts/cli_docs.py"


def test_the_page_names_every_command_and_flag():
    page = cli_docs.render()
    seen = 0

    def walk(command, path):
        nonlocal seen
        assert f"## {' '.join(path)}\n" in page, path
        for param in command.params:
            for flag in param.opts if param.param_type_name == "option" else []:
                assert f"{flag}" in page.split(f"## {' '.join(path)}\n")[1].split("\n## ")[0], (path, flag)
                seen += 1
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), ["mlx-spec"])
    assert seen > 100, seen  # the walk reached the commands' flags


def test_a_changed_help_text_shows_in_the_page(monkeypatch):
    """The comparison above can fail: the page follows the app's help."""
    command = typer.main.get_command(app)
    generate = command.commands["generate"]
    param = next(p for p in generate.params if p.name == "max_tokens")
    monkeypatch.setattr(param, "help", "A different help text.")
    monkeypatch.setattr(typer.main, "get_command", lambda _app: command)
    assert "A different help text." in cli_docs.render()
