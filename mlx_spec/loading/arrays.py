"""Evaluating everything a model holds, where it was made.

MLX streams belong to the thread that made them: an array left lazy on one thread fails
when another thread first evaluates it ("There is no Stream(cpu, 0) in current thread").
The server loads its models on the main thread and runs them on its worker, so a model
must leave the loader with no lazy array at all, not only its parameters.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def held_arrays(model: nn.Module) -> dict:
    """Every array `model` holds, as a tree: its parameters and the private ones that
    `parameters()` leaves out (names starting with "_", such as mlx-lm's Gemma 4 RoPE
    frequencies `rope._freqs`)."""
    return model.filter_and_map(lambda module, key, value: isinstance(value, (dict, list, mx.array)))


def evaluate_all(model: nn.Module) -> None:
    """Evaluate every array `model` holds (see `held_arrays`)."""
    mx.eval(held_arrays(model))
