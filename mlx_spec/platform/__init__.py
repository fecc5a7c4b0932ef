"""The libraries under us, as mlx-spec needs them: the BLAS MLX's CPU backend computes with
(`blas`, loaded before `mlx.core`) and mlx-lm's model classes without its package `__init__`
(`mlx_lm_import`). `mlx_spec.runtime` installs both when `mlx_spec` is imported."""
