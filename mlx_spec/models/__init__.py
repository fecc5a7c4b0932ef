"""Model architectures mlx-lm does not have, in mlx-lm's shape (`Model(args)`, `__call__`,
`sanitize`): Gemma 4's MTP assistant, and images into a language model's prefill through
mlx-vlm's vision towers. Loading models from files and stores is `mlx_spec.loading`."""
