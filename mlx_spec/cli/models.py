"""`mlx-spec models ...`: list presets, inspect a model."""

import typer

from mlx_spec.cli import app

models_app = typer.Typer(help="Model presets and model information.", no_args_is_help=True)
app.add_typer(models_app, name="models")
