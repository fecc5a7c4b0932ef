"""The `mlx-spec` command line: thin Typer commands that parse, call the library, render.

`app` (the root command, its flags and one-line errors) is `cli.app`; each command's module
registers itself on it when imported here.
"""

from mlx_spec.cli import bench, chat, generate, launch, models, serve  # noqa: F401  (registers the commands)
from mlx_spec.cli.app import app, click_errors, main

__all__ = ["app", "click_errors", "main"]
