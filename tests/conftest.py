"""Shared fixtures. Tiny random-weight Gemma 3 models (sliding window 16) are built
in-process; real-model fixtures load the packaged Gemma 3 270M."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_spec.models.tiny import perturbed_copy, tiny_gemma3


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_gemma3(seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """Close to the target: accepts most but not all draft tokens."""
    return perturbed_copy(tiny_target, noise=0.02, seed=1)


def greedy_reference(model, prompt_ids, max_tokens):
    """Plain greedy decoding by mlx-lm's own generate_step (its RotatingKVCache included)."""
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens)
    return [token for token, _ in steps]
