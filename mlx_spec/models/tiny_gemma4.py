"""Tiny random-weight Gemma 4 models: a target (mlx-lm's own `gemma4_text` class) and its
MTP assistant, for tests and overhead benchmarks.

The target keeps every feature real Gemma 4 checkpoints have that touches caches and
rollback: sliding and full layers with different head sizes, KV-shared layers (the last
ones reuse the K/V of the last non-shared layer of their type), per-layer inputs and the
logit soft-cap. `save_tiny_gemma4` writes it as a checkpoint folder; the assistant's
folder is written by `save_tiny_assistant` in the real checkpoints' key layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from mlx_spec.models.chat_templates import GEMMA4_CHAT_TEMPLATE
from mlx_spec.models.tiny import TINY_VOCAB, byte_tokenizer_json

# Gemma 4's turn markers take the places of Gemma 3's, so ids stay as in tiny.py.
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
BOS_ID, EOS_ID, END_OF_TURN_ID = 2, 1, 5
WINDOW = 16


def tiny_gemma4_config(**overrides) -> dict:
    """An mlx-lm `gemma4_text` config: 6 layers [sliding, sliding, full] x 2, of which the
    last 3 are KV-shared (layers 3, 4 read layer 1's K/V, layer 5 reads layer 2's), a
    16-token window, head sizes 32 (sliding) and 64 (full), per-layer inputs."""
    config = dict(
        model_type="gemma4_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=96,
        num_attention_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_key_value_heads=1,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=8,
        vocab_size=TINY_VOCAB,
        vocab_size_per_layer_input=TINY_VOCAB,
        rms_norm_eps=1e-6,
        sliding_window=WINDOW,
        sliding_window_pattern=3,
        max_position_embeddings=4096,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        eos_token_id=[EOS_ID, END_OF_TURN_ID],
    )
    config.update(overrides)
    return config


def tiny_gemma4(seed: int = 0, logit_scale: float = 4.0, dtype=mx.float32, **overrides):
    """A random-weight Gemma 4 text model built in-process.

    Args:
        seed: seeds MLX's global generator used by the layer initialisers.
        logit_scale: the final norm's gain (Gemma 4 norms multiply by the plain weight);
            larger makes next-token distributions peakier.
        dtype: parameter dtype.
        overrides: config fields to change.
    Returns:
        An mlx-lm ``gemma4_text.Model`` with tied embeddings, parameters evaluated.
    """
    config = tiny_gemma4_config(**overrides)
    mx.random.seed(seed)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    model.model.norm.weight = mx.full(model.model.norm.weight.shape, logit_scale)
    model.set_dtype(dtype)
    model.config = config
    mx.eval(model.parameters())
    return model


def last_kv_layers(args) -> dict[str, int]:
    """The last non-KV-shared layer of each attention type: the layers whose K/V an MTP
    assistant attends to (for the 12B, 46 and 47 of 48)."""
    first_shared = args.num_hidden_layers - args.num_kv_shared_layers
    return {args.layer_types[i]: i for i in range(first_shared)}


def _write_tokenizer(path: Path, chat_template: str) -> None:
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(SPECIAL_TOKENS)))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": chat_template,
    }, indent=2))


def save_tiny_gemma4(path: str | Path, model=None, *, chat_template: str | None = GEMMA4_CHAT_TEMPLATE,
                     **config_overrides) -> Path:
    """Write a tiny Gemma 4 target as a checkpoint folder (config.json, model.safetensors,
    byte-level tokenizer with Gemma 4's turn tokens). chat_template=None writes none, so the
    loader's fallback is exercised."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = tiny_gemma4(**config_overrides)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(model.config, indent=2))
    _write_tokenizer(path, chat_template or "")
    if chat_template is None:  # an empty template is still a template to transformers
        config = json.loads((path / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path
