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

from mlx_spec.loading.arrays import evaluate_all
from mlx_spec.loading.chat_templates import GEMMA4_CHAT_TEMPLATE, GEMMA_CHAT_TEMPLATE
from mlx_spec.loading.loader import load_model
from mlx_spec.testing.tiny import (
    SPECIAL_TOKENS,
    TINY_VOCAB,
    byte_tokenizer_json,
    perturbed_copy,
    save_tiny_model,
    tiny_gemma3_config,
)
from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, hf_gemma4_config

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
    path = Path(path)
    save_tiny_model(path, perturbed_copy(load_model(str(target_dir), progress=False).model.language_model, noise))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(target_dir) / name, path / name)
    return path


# ---------------------------------------------------------------------------------------
# Gemma 4: the same, with Gemma 4's tokens, per-image token counts and per-layer inputs
# ---------------------------------------------------------------------------------------

GEMMA4_IMAGE_TOKENS = ["<|image>", "<image|>", "<|image|>", "<|video|>"]  # boi, eoi, image, video
GEMMA4_PATCH, GEMMA4_POOLING, GEMMA4_MAX_SOFT_TOKENS = 4, 2, 9
GEMMA4_VOCAB = 288  # padded past the tokenizer's 16 + 4 special and 256 byte tokens


def gemma4_vision_special_tokens() -> list[str]:
    return TEMPLATE_SPECIAL_TOKENS + GEMMA4_IMAGE_TOKENS


def tiny_gemma4_vision_config(bidirectional: bool = False, **text_overrides) -> dict:
    """The Hugging Face form of a Gemma 4 vision config: the tiny Gemma 4 text model
    (`tiny_gemma4.hf_gemma4_config`: KV-shared layers, per-layer inputs, a 16-token window),
    a 1-layer vision tower on 4-pixel patches pooled 2 x 2, at most 9 soft tokens per image.
    `bidirectional`: `use_bidirectional_attention: "vision"`, as Gemma 4 12B and up."""
    specials = gemma4_vision_special_tokens()
    boi, eoi, image, video = (specials.index(t) for t in GEMMA4_IMAGE_TOKENS)
    text = hf_gemma4_config(vocab_size=GEMMA4_VOCAB, vocab_size_per_layer_input=GEMMA4_VOCAB,
                            use_bidirectional_attention="vision" if bidirectional else None, **text_overrides)
    eos = text.pop("eos_token_id")
    for name in ("architectures", "torch_dtype"):
        text.pop(name)
    return dict(
        model_type="gemma4",
        architectures=["Gemma4ForConditionalGeneration"],
        text_config=text,
        vision_config=dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16,
                           patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOLING,
                           position_embedding_size=16, default_output_length=GEMMA4_MAX_SOFT_TOKENS),
        audio_config=None,
        vocab_size=GEMMA4_VOCAB,
        image_token_id=image, boi_token_id=boi, eoi_token_id=eoi, video_token_id=video,
        vision_soft_tokens_per_image=GEMMA4_MAX_SOFT_TOKENS,
        pad_token_id=0,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )


def tiny_gemma4_vision(seed: int = 0, logit_scale: float = 4.0, bidirectional: bool = False, **text_overrides):
    """mlx-vlm's Gemma 4 `Model` (vision tower, embedder, language model) with random
    weights, evaluated; `.hf_config` holds the config it was built from."""
    from mlx_vlm.models import gemma4
    from mlx_vlm.utils import update_module_configs

    config = tiny_gemma4_vision_config(bidirectional, **text_overrides)
    mx.random.seed(seed)
    model_config = update_module_configs(gemma4.ModelConfig.from_dict(config), gemma4, config, ["text", "vision"])
    model = gemma4.Model(model_config)
    norm = model.language_model.model.norm
    norm.weight = mx.full(norm.weight.shape, logit_scale)  # Gemma 4 norms multiply by the plain weight
    # A random embedder's features would drown beside the scaled text embeddings: scale them up.
    projection = model.embed_vision.embedding_projection
    projection.weight = projection.weight * 8.0
    model.set_dtype(mx.float32)
    evaluate_all(model)
    model.hf_config = config
    return model


def save_tiny_gemma4_vision(path: str | Path, model=None, seed: int = 0, bidirectional: bool = False,
                            chat_template: str | None = None, **text_overrides) -> Path:
    """Write a tiny Gemma 4 vision checkpoint folder (as `save_tiny_gemma3_vision`), with
    Gemma 4's image tokens and Google's turn and tool tokens, and `chat_template` (our
    built-in Gemma 4 one if None); `text_overrides` change the text config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = model or tiny_gemma4_vision(seed, bidirectional=bidirectional, **text_overrides)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(model.hf_config, indent=2))
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(gemma4_vision_special_tokens())))
    boi, eoi, image, video = GEMMA4_IMAGE_TOKENS
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "extra_special_tokens": {"boi_token": boi, "eoi_token": eoi, "image_token": image, "video_token": video},
        "processor_class": "Gemma4Processor",
        "chat_template": chat_template or GEMMA4_CHAT_TEMPLATE,
    }, indent=2))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "image_seq_length": GEMMA4_MAX_SOFT_TOKENS,
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "patch_size": GEMMA4_PATCH,
                            "max_soft_tokens": GEMMA4_MAX_SOFT_TOKENS, "pooling_kernel_size": GEMMA4_POOLING,
                            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                            "do_normalize": False},
    }, indent=2))
    return path
