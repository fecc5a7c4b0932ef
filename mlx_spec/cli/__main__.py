"""`python -m mlx_spec.cli` runs the `mlx-spec` command."""

from mlx_spec.cli import main

main()
