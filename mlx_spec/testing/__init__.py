"""Models and files for tests and benchmarks, never shipped: the wheel leaves this package
out (pyproject.toml), so it imports only from a source checkout (`pip install -e .`).

    mlx_spec.testing.tiny         tiny random-weight Gemma 3 models, tokenizers, saved folders
    mlx_spec.testing.tiny_gemma4  tiny Gemma 4 targets and MTP assistants
    mlx_spec.testing.random_gguf  random-weight GGUF files of real shapes (the import bench)
    mlx_spec.testing.distill      an MTP assistant distilled from its tiny target in seconds,
                                  so acceptance is not chance
"""
