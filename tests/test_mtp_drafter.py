"""The MTP drafter: a Gemma 4 target with its assistant checkpoint, loaded by the real loader
and paired, run through the engine, the runner and the auto-γ cost measurement."""

import mlx.core as mx
import pytest

from mlx_spec.costs import measure_costs
from mlx_spec.drafters.mtp import MtpDrafter, shared_kv
from mlx_spec.errors import IncompatibleModelsError, MlxSpecError
from mlx_spec.models import load_pair
from mlx_spec.models.gemma4_assistant import forward_with_hidden
from mlx_spec.models.tiny import save_tiny_model
from mlx_spec.models.tiny_gemma4 import (
    WINDOW,
    save_tiny_assistant,
    save_tiny_gemma4,
    tiny_assistant_config,
)
from mlx_spec.runner import build_engine


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    save_tiny_gemma4(root / "target")
    save_tiny_assistant(root / "assistant")  # centroid head, as E2B/E4B
    save_tiny_assistant(root / "dense", tiny_assistant_config(centroids=False))  # as 12B
    save_tiny_model(root / "gemma3")
    return root


@pytest.fixture(scope="module")
def pair(folders):
    return load_pair(str(folders / "target"), str(folders / "assistant"), dtype="float32", progress=False)


def test_pairing_detects_the_assistant(pair):
    assert pair.draft.tokenizer is None and pair.vocab_size_draft == pair.vocab_size_target
    engine = build_engine(pair)  # no --drafter: the checkpoint's type decides
    assert isinstance(engine.drafter, MtpDrafter) and engine.drafter.layers == {
        "sliding_attention": 1, "full_attention": 2}
    with pytest.raises(MlxSpecError, match="--drafter mtp"):
        build_engine(pair, "model")


def test_mismatched_pairs_fail_with_one_line(folders):
    with pytest.raises(IncompatibleModelsError, match="Gemma 4 targets only") as error:
        load_pair(str(folders / "gemma3"), str(folders / "assistant"), progress=False)
    assert "\n" not in str(error.value)
    draft = load_pair(str(folders / "target"), str(folders / "target"), progress=False)
    with pytest.raises(MlxSpecError, match="needs a Gemma 4 MTP assistant"):
        build_engine(draft, "mtp")


def test_forward_with_hidden_is_the_target_forward(pair):
    model = pair.target.model
    ids = mx.array([[2, 40, 41, 42, 43, 44]])
    logits, hidden = forward_with_hidden(model, ids, None)
    assert mx.array_equal(logits, model(ids)).item()
    assert hidden.shape == (1, 6, pair.target.config["hidden_size"])


def test_shared_kv_reads_the_target_cache_in_order(pair):
    """The K/V the assistant reads equal a fresh pass's, sliding ones cut to window − 1."""
    engine = build_engine(pair)
    cache = engine.make_prompt_cache()
    ids = [2] + [(5 * i) % 250 + 6 for i in range(40)]
    cache.target.prefill(ids)
    kv = shared_kv(cache.target.cache, {"sliding_attention": 1, "full_attention": 2}, WINDOW)
    assert kv["sliding_attention"][0].shape[2] == WINDOW - 1 and kv["full_attention"][0].shape[2] == 41
    fresh = pair.target.model.make_cache()
    pair.target.model(mx.array([ids]), cache=fresh)
    assert mx.allclose(kv["full_attention"][0], fresh[2].keys[..., :41, :]).item()
    sliding = fresh[1].state[0]  # mlx-lm's rotating cache, unwrapped: the newest 16 in order
    assert mx.allclose(kv["sliding_attention"][1], fresh[1].state[1][..., -(WINDOW - 1):, :]).item()
    assert mx.allclose(kv["sliding_attention"][0], sliding[..., -(WINDOW - 1):, :]).item()


def test_auto_gamma_times_the_assistant_step(pair):
    curve = measure_costs(pair.target.model, pair.draft.model, max_width=3, context=256)
    assert 0 < curve.draft_step == curve.draft_step2  # no catch-up step for the assistant
    assert curve.c < 1
