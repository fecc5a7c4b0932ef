"""A model folder into an mlx-lm model (`load_folder`): an MLX or Hugging Face checkpoint,
or a folder our GGUF import wrote, with the float32 copy of such a folder's weights
(`FLOAT32_COPY`)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading import derived, gguf_import
from mlx_spec.loading.arrays import evaluate_all
from mlx_spec.models import gemma4_assistant


def context_length(config: dict) -> int | None:
    """Positions the model was trained for (max_position_embeddings, in its text config or at
    the top), if the config says."""
    text = config.get("text_config") or config
    value = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return int(value) if value else None


def load_folder(path: Path, *, lazy: bool = True, dtype: str | None = None) -> tuple[nn.Module, dict]:
    """mlx-lm model and config from a folder, with a one-line error for what is missing.
    `dtype`: the dtype the caller will cast to; "float32" reads a GGUF import's float32
    copy where one was made (`float32_copy_due`), so no cast is left to do."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json, so it is not an MLX or Hugging Face "
                             "model folder")
    if not any(path.glob("model*.safetensors")):
        found = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".gguf")][:3]
        hint = f" (found {', '.join(found)}; convert with mlx_lm.convert)" if found else ""
        raise ModelLoadError(f"{path} has no model*.safetensors weights{hint}")
    try:
        if gguf_import.is_imported(path):
            return _load_imported(path, lazy=lazy, float32=dtype == "float32")
        # Gemma 4 MTP assistants are not an mlx-lm architecture: our class, mlx-lm's loading
        # (quantized checkpoints included).
        from mlx_lm.utils import load_model as mlx_lm_load_model

        return mlx_lm_load_model(path, lazy=lazy, get_model_classes=gemma4_assistant.assistant_classes)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load the model in {path}: {reason}") from None


def _load_imported(path: Path, *, lazy: bool, float32: bool = False) -> tuple[nn.Module, dict]:
    """What mlx-lm's `load_model` does for a folder our GGUF import wrote (one architecture
    mlx-lm has or our MTP assistant, float16 or per-layer quantized safetensors, no remote
    code), without importing `mlx_lm.utils`
    and with it transformers (~1 s of a warm run; `mlx_spec.runtime.mlx_lm_import`)."""
    import importlib

    config = json.loads((path / "config.json").read_text())
    if gemma4_assistant.is_assistant_config(config):
        model = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_dict(config))
    else:
        try:
            arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        except ImportError as error:
            raise ValueError(f"Model type {config['model_type']} not supported.") from error
        model = arch.Model(arch.ModelArgs.from_dict(config))
    copy = path / FLOAT32_COPY
    weights = {}
    for file in sorted((copy if float32 and (copy / _COPY_DONE).is_file() else path).glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if (quantization := config.get("quantization")) is not None:
        # A quantized import lists every quantized layer with its bits (Q6_K layers take
        # 8, Q4_K ones 4); the rest stay float.
        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=lambda p, m: quantization.get(p, False))
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        evaluate_all(model)
    return model, config


# A float16 GGUF import loaded in float32 on a CPU spends most of a warm start casting
# (1.1 s of 268M parameters for the 270M on 2 cores; reading them is 0.3 s). The first such
# load writes a float32 copy of the weights beside them, read as it is from then on: twice
# the disk (1.07 GB for the 270M) for a load without a cast. The float16 files stay for
# other dtypes and devices; deleting the copy only brings the cast back.
FLOAT32_COPY = "float32"
_COPY_DONE = "complete"  # written last: a copy without it is ignored (and rewritten)


def float32_copy_due(path: Path, dtype: str | None, config: dict) -> bool:
    """Whether loading `path` (whose config.json is `config`) in `dtype` should leave a
    float32 copy of its weights: a float16 (unquantized) GGUF import, loaded in float32 on
    a CPU, without a copy yet."""
    if dtype != "float32" or mx.default_device() != mx.cpu or not gguf_import.is_imported(path):
        return False
    if (path / FLOAT32_COPY / _COPY_DONE).is_file():
        return False
    # The import's record says what it stored (older records say nothing: float16 then).
    stored = json.loads((path / "mlx_spec_source.json").read_text()).get("dtype", "float16")
    return stored == "float16" and "quantization" not in config


def write_float32_copy(path: Path) -> None:
    """Write the float32 copy of an import's weights (see FLOAT32_COPY): each file cast
    exactly as a load casts it, into a temporary folder renamed into place, so a reader
    sees a whole copy or none. A cache that cannot take it (disk full, read-only) keeps
    loading with the cast, after one warning."""
    copy = path / FLOAT32_COPY

    def fill(scratch: Path) -> None:
        for file in sorted(path.glob("model*.safetensors")):
            weights = {name: value.astype(mx.float32) if mx.issubdtype(value.dtype, mx.floating) else value
                       for name, value in mx.load(str(file)).items()}
            mx.save_safetensors(str(scratch / file.name), weights, metadata={"format": "mlx"})
        (scratch / _COPY_DONE).write_text("")

    try:
        derived.publish(copy, fill, landed=(copy / _COPY_DONE).is_file)
    except (OSError, RuntimeError) as error:  # MLX's writer raises RuntimeError
        if (copy / _COPY_DONE).is_file():
            return  # lost a race to another process writing the same copy: it is there
        warnings.warn(f"could not write a float32 copy of {path} ({getattr(error, 'strerror', None) or error}); "
                      "loads keep casting the float16 weights", stacklevel=3)
