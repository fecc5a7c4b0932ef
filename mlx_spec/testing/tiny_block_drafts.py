"""Tiny random block drafts for a tiny Gemma 4 target, built with mlx-vlm's own drafter
classes (the independent reference) and written in the Hub packagings, for tests and
overhead benchmarks. mlx-vlm is a test dependency only: nothing outside tests and
benchmarks imports this module.

DFlash: z-lab's packaging (`model_type: qwen3` with `dflash_config`, transformers-5
`rope_parameters` with no top-level `rope_theta`, `layer_types`, a sliding window); the
weights are mlx-vlm's `DFlashDraftModel`'s parameters under z-lab's names.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel
from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig

from mlx_spec.models.arrays import evaluate_all
from mlx_spec.testing.tiny_gemma4 import WINDOW, tiny_gemma4_config

MASK_ID = 3  # <unk> in the tiny byte tokenizer: a token the target never needs


def tiny_dflash_config(target_config: dict | None = None, *, block_size: int = 8, taps=(1, 3, 5),
                       **overrides) -> dict:
    """A DFlash config.json for the tiny Gemma 4 target (`target_config`): 2 layers (sliding,
    full), tapping target layers `taps`, blocks of `block_size` (1 given + block_size − 1
    drafted)."""
    target = target_config or tiny_gemma4_config()
    config = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_size=target["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        vocab_size=target["vocab_size"],
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=target.get("sliding_window", WINDOW),
        final_logit_softcapping=target.get("final_logit_softcapping"),
        tie_word_embeddings=True,
        block_size=block_size,
        num_target_layers=target["num_hidden_layers"],
        dflash_config={"block_size": block_size, "target_layer_ids": list(taps), "mask_token_id": MASK_ID},
    )
    config.update(overrides)
    return config


def reference_dflash(config: dict, seed: int = 0) -> DFlashDraftModel:
    """mlx-vlm's DFlash draft for `config`, random weights (seeded)."""
    mx.random.seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(config))
    evaluate_all(model)
    return model


def save_tiny_dflash(path: str | Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write a tiny DFlash draft folder (config.json, model.safetensors) as z-lab ships them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config or tiny_dflash_config()
    model = reference_dflash(config, seed)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
