"""Fixtures for the CLI tests, loaded as a plugin (`pytest_plugins = ["cli_fixtures"]`):
tiny Gemma 3 and Gemma 4 models saved as mlx-lm folders (a target and a close draft) and a
private cost-curve cache."""

import pytest

from mlx_spec.testing.tiny import perturbed_copy, save_tiny_model, tiny_gemma3


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(target dir, draft dir): the draft is a slightly perturbed copy, so most but not all
    draft tokens are accepted."""
    root = tmp_path_factory.mktemp("cli-models")
    target = tiny_gemma3(seed=0)
    save_tiny_model(root / "target", target)
    save_tiny_model(root / "draft", perturbed_copy(target, noise=0.02, seed=1))
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="session")
def gemma4_dirs(tmp_path_factory):
    """A folder holding tiny Gemma 4 checkpoints: target/, draft/ (a close copy),
    assistant/ (its MTP assistant) and bare/ (the target without a chat template)."""
    from mlx_spec.testing.tiny_gemma4 import save_tiny_assistant, save_tiny_gemma4, tiny_gemma4

    root = tmp_path_factory.mktemp("gemma4")
    target = tiny_gemma4(seed=0)
    save_tiny_gemma4(root / "target", target)
    save_tiny_gemma4(root / "draft", perturbed_copy(target, noise=0.02, seed=1))
    save_tiny_gemma4(root / "bare", target, chat_template=None)
    save_tiny_assistant(root / "assistant")
    return root


@pytest.fixture(scope="session")
def cost_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cost-cache")


@pytest.fixture
def private_cost_cache(cost_cache, monkeypatch):
    """Cost curves go to a per-session folder, never the user's cache (CLI test modules use
    it through `pytestmark`; it is not autouse because this module is a plugin)."""
    monkeypatch.setenv("MLX_SPEC_CACHE", str(cost_cache))
    monkeypatch.delenv("MLX_SPEC_DEBUG", raising=False)


@pytest.fixture
def models(tiny_dirs):
    target, draft = tiny_dirs
    return ["--model", target, "--draft-model", draft]
