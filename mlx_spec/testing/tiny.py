"""Tiny random-weight Gemma-3-architecture models for tests and overhead benchmarks.

They use mlx-lm's own `gemma3_text` model class, so every code path (sliding-window layers,
rotating caches, masks) is the one real Gemma checkpoints take; only the sizes shrink. The
byte-level tokenizer has Gemma's special turn tokens so chat templates work too.
"""

from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text

from mlx_spec.loading.arrays import evaluate_all
from mlx_spec.loading.chat_templates import GEMMA_CHAT_TEMPLATE

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
BOS_ID, EOS_ID, END_OF_TURN_ID = 2, 1, 5
BYTE_VOCAB = len(SPECIAL_TOKENS) + 256  # 262 real tokens
TINY_VOCAB = 272  # padded past the tokenizer, as real Gemma checkpoints are


def tiny_gemma3_config(**overrides) -> dict:
    """An mlx-lm `gemma3_text` config with a 16-token sliding window and 4 layers
    (sliding, global, sliding, global)."""
    config = dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=2,
        head_dim=32,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        vocab_size=TINY_VOCAB,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=32,
        sliding_window=16,
        sliding_window_pattern=2,
        max_position_embeddings=4096,
        eos_token_id=[EOS_ID, END_OF_TURN_ID],
    )
    config.update(overrides)
    return config


def tiny_gemma3(seed: int = 0, logit_scale: float = 4.0, dtype=mx.float32, **overrides):
    """A random-weight Gemma 3 text model built in-process.

    Args:
        seed: seeds MLX's global generator used by the layer initialisers.
        logit_scale: the final norm gain; larger makes next-token distributions peakier
            (random models are otherwise nearly uniform).
        dtype: parameter dtype.
        overrides: config fields to change (e.g. ``vocab_size=8``).
    Returns:
        An mlx-lm ``gemma3_text.Model`` with tied embeddings, parameters evaluated.
    """
    config = tiny_gemma3_config(**overrides)
    mx.random.seed(seed)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    model.sanitize({})  # no lm_head weight: tie it to the embedding, as Gemma does
    model.model.norm.weight = mx.full(model.model.norm.weight.shape, logit_scale - 1.0)
    model.set_dtype(dtype)
    model.config = config
    evaluate_all(model)
    return model


def perturbed_copy(model, noise: float = 0.05, seed: int = 1):
    """A draft that agrees with `model` most of the time: every parameter plus Gaussian
    noise of `noise` times that parameter's standard deviation. Works for any mlx-lm
    model class (Gemma 3 and Gemma 4 here)."""
    config = dict(getattr(model, "config", None) or vars(model.args))  # built here, or loaded
    arch = import_module(type(model).__module__)
    copy = arch.Model(arch.ModelArgs.from_dict(config))
    copy.sanitize({})  # Gemma 3: no lm_head weight, tie it to the embedding
    params = sorted(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(params))
    noisy = {}
    for (name, p), key in zip(params, keys):
        eps = mx.random.normal(p.shape, key=key).astype(p.dtype)
        scale = mx.std(p.astype(mx.float32)) if p.size > 1 else mx.array(0.0)
        noisy[name] = p + noise * scale.astype(p.dtype) * eps
    copy.load_weights(list(noisy.items()))
    copy.config = config
    evaluate_all(copy)
    return copy


def byte_tokenizer_json(special_tokens: list[str] = SPECIAL_TOKENS) -> dict:
    """A byte-level BPE tokenizer (no merges): every byte is one token, after Gemma's
    special tokens (BOS at id 2); BOS is prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(special_tokens)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    return json.loads(tok.to_str())


def save_tiny_model(path: str | Path, model=None, **config_overrides) -> Path:
    """Write a tiny model as an mlx-lm folder (config.json, model.safetensors, tokenizer)
    so every loader and CLI path can open it like a downloaded checkpoint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = tiny_gemma3(**config_overrides)
    config = dict(model.config)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("lm_head")}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "chat_template": GEMMA_CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return path
