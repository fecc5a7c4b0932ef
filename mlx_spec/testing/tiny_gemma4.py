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

from mlx_spec.loading.arrays import evaluate_all
from mlx_spec.loading.chat_templates import GEMMA4_CHAT_TEMPLATE
from mlx_spec.models import gemma4_assistant
from mlx_spec.testing.tiny import TINY_VOCAB, byte_tokenizer_json

# Gemma 4's turn markers take the places of Gemma 3's, so ids stay as in tiny.py.
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
# And the markers Google's own chat template writes (tools, calls, answers, thinking channel).
TEMPLATE_SPECIAL_TOKENS = SPECIAL_TOKENS + [
    "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
    '<|"|>', "<|channel>", "<channel|>", "<|think|>"]
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
    evaluate_all(model)
    return model


def _write_tokenizer(path: Path, chat_template: str, special_tokens: list[str] = SPECIAL_TOKENS) -> None:
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(special_tokens)))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": chat_template,
    }, indent=2))


def save_tiny_gemma4(path: str | Path, model=None, *, chat_template: str | None = GEMMA4_CHAT_TEMPLATE,
                     special_tokens: list[str] = SPECIAL_TOKENS, **config_overrides) -> Path:
    """Write a tiny Gemma 4 target as a checkpoint folder (config.json, model.safetensors,
    byte-level tokenizer with Gemma 4's turn tokens, or `special_tokens`: e.g.
    TEMPLATE_SPECIAL_TOKENS for Google's own template). chat_template=None writes none, so the
    loader's fallback is exercised."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = tiny_gemma4(**config_overrides)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(model.config, indent=2))
    _write_tokenizer(path, chat_template or "", special_tokens)
    if chat_template is None:  # an empty template is still a template to transformers
        config = json.loads((path / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


# ---------------------------------------------------------------------------------------
# The MTP assistant, in the released checkpoints' config schema and key layout
# ---------------------------------------------------------------------------------------


def tiny_assistant_config(target_config: dict | None = None, *, centroids: bool = True,
                          **text_overrides) -> dict:
    """A config.json for a tiny assistant of `target_config` (default: the tiny target), in
    the schema of the released checkpoints: `gemma4_assistant` with the centroid head (as
    E2B/E4B) or `gemma4_unified_assistant` with the tied dense head (as 12B). 16 centroids
    of 17 tokens, top 4, so 68 of the 272 tokens get real logits."""
    target = target_config or tiny_gemma4_config()
    text = dict(
        model_type="gemma4_text" if centroids else "gemma4_unified_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        global_head_dim=target["global_head_dim"],
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=target["sliding_window"],
        num_kv_shared_layers=4,
        rms_norm_eps=1e-6,
        vocab_size=target["vocab_size"],
        max_position_embeddings=target["max_position_embeddings"],
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters=target["rope_parameters"],
        final_logit_softcapping=None,
        tie_word_embeddings=True,
        use_double_wide_mlp=False,
        attention_k_eq_v=False,
    )
    if centroids:  # fields the unified text config does not have
        text.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False)
    text.update(text_overrides)
    return dict(
        model_type="gemma4_assistant" if centroids else "gemma4_unified_assistant",
        architectures=["Gemma4AssistantForCausalLM" if centroids else "Gemma4UnifiedAssistantForCausalLM"],
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=centroids,
        num_centroids=16,
        centroid_intermediate_top_k=4,
        tie_word_embeddings=True,
        text_config=text,
    )


def tiny_assistant_weights(config: dict, seed: int = 0) -> dict:
    """Random weights for `config` as numpy arrays under the checkpoints' key names.

    Drawn with numpy's legacy `RandomState`, whose streams never change, so a committed
    script and a test on another machine rebuild bit-identical weights. Norm gains and layer
    scalars are drawn around 1 (not all ones), so a `1 + w` norm or a dropped scalar shows."""
    import numpy as np


    model = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_dict(config))
    rng = np.random.RandomState(seed)
    weights = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        shape = tuple(param.shape)
        if name.endswith("token_ordering"):
            weights[name] = rng.permutation(shape[0]).astype(np.int64)
        elif name.endswith(("norm.weight", "layer_scalar")):
            weights[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            weights[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        else:  # projections [out, in]
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return weights


def save_tiny_assistant(path: str | Path, config: dict | None = None, weights: dict | None = None,
                        seed: int = 0) -> Path:
    """Write an assistant checkpoint folder: config.json and model.safetensors (no
    tokenizer: the assistant speaks the target's vocabulary)."""
    import numpy as np

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config or tiny_assistant_config()
    weights = weights if weights is not None else tiny_assistant_weights(config, seed)
    # mx.array keeps int64; safetensors stores token_ordering as I64, as the releases do
    mx.save_safetensors(str(path / "model.safetensors"),
                        {k: mx.array(np.asarray(v)) for k, v in weights.items()})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# ---------------------------------------------------------------------------------------
# The target in Hugging Face layout, for llama.cpp's converter (tests/data/make_gemma4_gguf.py)
# ---------------------------------------------------------------------------------------

# A Gemma-style SentencePiece vocabulary of TINY_VOCAB tokens: specials, the 256 byte-fallback
# tokens, and a few pieces with merges, so the BPE merge path is exercised too.
SENTENCEPIECE_PIECES = ["▁", "t", "h", "e", "a", "n", "▁t", "he", "▁the", "▁a"]
SENTENCEPIECE_MERGES = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a")]


def hf_gemma4_config(**overrides) -> dict:
    """`tiny_gemma4_config` as a Hugging Face `Gemma4ForCausalLM` config.json spells it:
    every field explicit (layer types, double-wide MLP, K = V), since converters read the
    file, not mlx-lm's defaults."""
    config = tiny_gemma4_config(**overrides)
    args = gemma4_text.ModelArgs.from_dict(config)
    config.update(
        architectures=["Gemma4ForCausalLM"],
        layer_types=list(args.layer_types),
        use_double_wide_mlp=args.use_double_wide_mlp,
        attention_k_eq_v=args.attention_k_eq_v,
        num_global_key_value_heads=args.num_global_key_value_heads,
        hidden_activation="gelu_pytorch_tanh",
        enable_moe_block=False,
        bos_token_id=BOS_ID,
        pad_token_id=0,
        torch_dtype="float32",
    )
    return config


def tiny_gemma4_weights(config: dict, seed: int = 0) -> dict:
    """Random weights for an mlx-lm `gemma4_text` config, as numpy arrays under the names
    mlx-lm and Hugging Face share. numpy's legacy `RandomState` streams never change, so a
    committed GGUF and a test on another machine see the same checkpoint. Norm gains and
    layer scalars are drawn around 1; the final norm around 4, for peaky distributions."""
    import numpy as np

    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    rng = np.random.RandomState(seed)
    weights = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        shape = tuple(param.shape)
        if name == "model.norm.weight":
            weights[name] = rng.uniform(3.0, 5.0, shape).astype(np.float32)
        elif name.endswith(("norm.weight", "layer_scalar")):
            weights[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        elif name.startswith("model.embed_tokens"):
            weights[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        else:  # projections [out, in]
            weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return weights


def save_sentencepiece_tokenizer(path: Path) -> None:
    """tokenizer.json + tokenizer_config.json of a Gemma-style BPE vocabulary (byte fallback,
    `▁` for spaces), built by transformers' own `GemmaTokenizer`, so the file has the layout
    real Gemma checkpoints ship and llama.cpp's converter reads."""
    from transformers import GemmaTokenizer

    tokens = SPECIAL_TOKENS + [f"<0x{b:02X}>" for b in range(256)] + SENTENCEPIECE_PIECES
    assert len(tokens) == TINY_VOCAB
    tokenizer = GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=SENTENCEPIECE_MERGES,
                               bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                               additional_special_tokens=SPECIAL_TOKENS[4:])
    tokenizer.chat_template = GEMMA4_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))


def save_hf_gemma4(path: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a tiny Gemma 4 target as a Hugging Face checkpoint folder (float32
    safetensors, Gemma-style tokenizer); mlx-lm and llama.cpp's converter both read it."""
    import numpy as np

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_gemma4_config(**config_overrides)
    weights = tiny_gemma4_weights(config, seed)
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(np.asarray(v)) for k, v in weights.items()},
                        metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_sentencepiece_tokenizer(path)
    return path


# The checkpoints tests/data/make_gemma4_gguf.py converts with llama.cpp and
# tests/loading/test_gemma4_gguf.py.py rebuilds to compare against: an E2B-like target (per-layer
# inputs, KV-shared layers, double-wide MLP), a 12B-like one (K = V full layers with one
# global K/V head, no sharing) and the 12B-like target's dense-head assistant.
TWELVE_B_LIKE = dict(num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True,
                     num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                     use_double_wide_mlp=False)


def save_hf_checkpoints(root: str | Path) -> dict[str, Path]:
    """Write the three Hugging Face folders under `root`; returns {name: folder}."""
    import shutil

    root = Path(root)
    folders = {"e2b": save_hf_gemma4(root / "e2b", seed=0),
               "12b": save_hf_gemma4(root / "12b", seed=1, **TWELVE_B_LIKE)}
    target = json.loads((folders["12b"] / "config.json").read_text())
    # moe_intermediate_size: every released config has the key (null), and the converter asks for it
    config = tiny_assistant_config(target, centroids=False, num_global_key_value_heads=1,
                                   attention_k_eq_v=True, moe_intermediate_size=None)
    folders["12b-assistant"] = save_tiny_assistant(root / "12b-assistant", config, seed=2)
    # llama.cpp's converter writes the vocabulary into every GGUF: the assistant's folder
    # carries its target's tokenizer, as the released assistants' repos do.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["12b"] / name, folders["12b-assistant"] / name)
    return folders
