"""A tiny random-weight Gemma 3 vision checkpoint, built with mlx-vlm's own model classes.

`save_tiny_gemma3_vision` writes a folder laid out as mlx-vlm and Hugging Face lay out a
Gemma 3 4B+ checkpoint: config.json with `text_config` and `vision_config`, one safetensors
file holding `language_model.*`, `vision_tower.*` and `multi_modal_projector.*`, the image
processor's and processor's configs, and a byte-level tokenizer with Gemma 3's image tokens
and a chat template that renders an image part as `<start_of_image>`, as Google's does.
Only the sizes shrink: a 32-pixel image in 8-pixel patches, pooled to 4 image tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec.models.chat_templates import GEMMA_CHAT_TEMPLATE
from mlx_spec.models.arrays import evaluate_all
from mlx_spec.testing.tiny import (SPECIAL_TOKENS, TINY_VOCAB, byte_tokenizer_json, perturbed_copy,
                                   save_tiny_model, tiny_gemma3_config)

IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
VISION_SPECIAL_TOKENS = SPECIAL_TOKENS + IMAGE_TOKENS
BOI_ID, EOI_ID, IMAGE_ID = (VISION_SPECIAL_TOKENS.index(t) for t in IMAGE_TOKENS)
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 32, 8, 4


def tiny_gemma3_vision_config(**text_overrides) -> dict:
    """The Hugging Face form of a Gemma 3 vision config (what `from_pretrained` reads)."""
    text = tiny_gemma3_config(**text_overrides)
    text.pop("eos_token_id")
    return dict(
        model_type="gemma3",
        text_config={**text, "mm_tokens_per_image": TOKENS_PER_IMAGE},
        vision_config=dict(model_type="siglip_vision_model", num_hidden_layers=2, hidden_size=32,
                           intermediate_size=64, num_attention_heads=2, patch_size=PATCH_SIZE,
                           image_size=IMAGE_SIZE, layer_norm_eps=1e-6),
        vocab_size=TINY_VOCAB,
        hidden_size=text["hidden_size"],
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE_ID,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
        pad_token_id=0,
        eos_token_id=[1, 5],
    )


def tiny_gemma3_vision(seed: int = 0, logit_scale: float = 4.0, **text_overrides):
    """mlx-vlm's Gemma 3 `Model` (vision tower, projector, language model) with random
    weights, evaluated; `.hf_config` holds the config it was built from."""
    from mlx_vlm.models import gemma3
    from mlx_vlm.utils import update_module_configs

    config = tiny_gemma3_vision_config(**text_overrides)
    mx.random.seed(seed)
    model_config = update_module_configs(gemma3.ModelConfig.from_dict(config), gemma3, config, ["text", "vision"])
    model = gemma3.Model(model_config)
    norm = model.language_model.model.norm
    norm.weight = mx.full(norm.weight.shape, logit_scale - 1.0)
    # A random projector's unit-scale features would drown the text: scale them to the embeddings'.
    projector = model.multi_modal_projector
    projector.mm_input_projection_weight = mx.random.normal(projector.mm_input_projection_weight.shape) * 0.5
    model.set_dtype(mx.float32)
    evaluate_all(model)
    model.hf_config = config
    return model


def save_tiny_gemma3_vision(path: str | Path, model=None, seed: int = 0) -> Path:
    """Write the tiny vision checkpoint folder (see the module docstring)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = model or tiny_gemma3_vision(seed)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if "lm_head" not in k}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(model.hf_config, indent=2))
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(VISION_SPECIAL_TOKENS)))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "extra_special_tokens": {"boi_token": IMAGE_TOKENS[0], "eoi_token": IMAGE_TOKENS[1],
                                 "image_token": IMAGE_TOKENS[2]},
        "processor_class": "Gemma3Processor",
        "chat_template": GEMMA_CHAT_TEMPLATE,
    }, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_resize": True, "resample": 2,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
        "do_pan_and_scan": False,
    }, indent=2))
    (path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": TOKENS_PER_IMAGE}, indent=2))
    return path


def save_text_draft(path: str | Path, target_dir: str | Path, noise: float = 0.02) -> Path:
    """A text-only draft for the checkpoint in `target_dir`: its language model (as our
    loader reads it) with `noise` added, saved with the same tokenizer."""
    from mlx_spec.models.loader import load_model

    path = Path(path)
    save_tiny_model(path, perturbed_copy(load_model(str(target_dir), progress=False).model.language_model, noise))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(target_dir) / name, path / name)
    return path
