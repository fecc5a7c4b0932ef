"""Getting target and draft models into MLX memory."""
