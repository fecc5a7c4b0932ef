"""Tiny random block drafts for a tiny Gemma 4 target, built with mlx-vlm's own drafter
classes (the independent reference) and written in the Hub packagings, for tests and
overhead benchmarks. mlx-vlm is a test dependency only: nothing outside tests and
benchmarks imports this module.

DFlash: z-lab's packaging (`model_type: qwen3` with `dflash_config`, transformers-5
`rope_parameters` with no top-level `rope_theta`, `layer_types`, a sliding window); the
weights are mlx-vlm's `DFlashDraftModel`'s parameters under z-lab's names.

EAGLE-3: vLLM's speculators packaging (`speculators_config`, a Llama
`transformer_layer_config`, a reduced vocabulary with `d2t` and `t2d`); the weights are
mlx-vlm's `Eagle3DraftModel`'s.

DFlash 2: DFlash's packaging with `architectures: ["DFlash2DraftModel"]` and the DFlash 2
fields under `dflash_config`; the weights are mlx-vlm's `DFlash2DraftModel`'s (its base
kernels, zero at construction, drawn at random too), the two codebooks stored without a
`.weight` suffix as released.

DSpark: DeepSpec's native Gemma 4 packaging (`Gemma4DSparkModel`, `model_type: gemma4_text`,
flat DSpark fields); the weights are mlx-vlm's `Gemma4DSparkDraftModel`'s, which cannot be
built with `attention_k_eq_v` (it crashes), so a K = V folder is written from a K ≠ V one
less its `v_proj` tensors. SpecForge's packaging (a Qwen 3 DFlash config with
`dflash_config.projector_type: "dspark"`): mlx-vlm's `DSparkDraftModel`'s weights. vLLM's
speculators packaging (`speculators_config.algorithm: "dspark"`, a Gemma 4
`transformer_layer_config`, `aux_hidden_state_layer_ids`, a reduced vocabulary with `d2t`
and `t2d`): mlx-vlm's Gemma 4 class's weights for the DeepSpec config it amounts to
(`speculators_as_native`), lm_head and markov_w2 cut to the draft vocabulary's rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters.dflash2 import DFlash2DraftModel
from mlx_vlm.speculative.drafters.dflash2.config import DFlash2Config
from mlx_vlm.speculative.drafters.dspark import DSparkDraftModel
from mlx_vlm.speculative.drafters.dspark.config import DSparkConfig
from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel
from mlx_vlm.speculative.drafters.gemma4_dspark import Gemma4DSparkDraftModel
from mlx_vlm.speculative.drafters.gemma4_dspark.config import Gemma4DsparkConfig
from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel
from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig

from mlx_spec.loading.arrays import evaluate_all
from mlx_spec.testing.tiny_gemma4 import WINDOW, tiny_gemma4_config

MASK_ID = 3  # <unk> in the tiny byte tokenizer: a token the target never needs


def reference_model(model_class, config_class, config: dict, seed: int):
    """mlx-vlm's `model_class` for `config` (read by its `config_class`), random weights
    (seeded)."""
    mx.random.seed(seed)
    model = model_class(config_class.from_dict(config))
    evaluate_all(model)
    return model


def write_folder(path: str | Path, config: dict, weights: dict) -> Path:
    """A draft folder as the Hub holds one: config.json and model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


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
    return reference_model(DFlashDraftModel, DFlashConfig, config, seed)


def save_tiny_dflash(path: str | Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write a tiny DFlash draft folder (config.json, model.safetensors) as z-lab ships them."""
    config = config or tiny_dflash_config()
    return write_folder(path, config, dict(tree_flatten(reference_dflash(config, seed).parameters())))


# ---------------------------------------------------------------------------------------
# EAGLE-3, in vLLM's speculators format
# ---------------------------------------------------------------------------------------


def tiny_eagle3_config(target_config: dict | None = None, *, draft_vocab: int = 64, aux=(2, 4, 5),
                       hidden_act: str = "silu", **overrides) -> dict:
    """An EAGLE-3 config.json (speculators format) for the tiny Gemma 4 target: one layer,
    a draft vocabulary of `draft_vocab` ids, aux hidden states `aux` (HF indices)."""
    target = target_config or tiny_gemma4_config()
    config = dict(
        architectures=["Eagle3Speculator"],
        speculators_model_type="eagle3",
        speculators_config={"algorithm": "eagle3",
                            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                            "verifier": {"architectures": ["Gemma4ForCausalLM"]}},
        draft_vocab_size=draft_vocab,
        target_hidden_size=target["hidden_size"],
        eagle_aux_hidden_state_layer_ids=list(aux),
        norm_before_residual=True,
        tie_word_embeddings=False,
        transformer_layer_config=dict(
            model_type="llama", hidden_size=target["hidden_size"], intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
            vocab_size=target["vocab_size"], max_position_embeddings=4096, rope_theta=10_000.0,
            hidden_act=hidden_act),
    )
    config.update(overrides)
    return config


def draft_vocabulary(size: int, width: int, skip: tuple = ()) -> list[int]:
    """`size` target ids spread over [0, width), none of `skip`, ascending (d2t's order)."""
    ids = [i for i in range(0, width, max(1, width // (size + len(skip)))) if i not in skip]
    return ids[:size]


def reference_eagle3(config: dict, vocab_ids: list[int], seed: int = 0, embed: mx.array | None = None):
    """mlx-vlm's EAGLE-3 draft for `config`, random weights (seeded), its d2t mapping draft
    id d to target id vocab_ids[d]; `embed`: the embedding rows (released drafts copy the
    target's, which mlx-vlm then uses in their place)."""
    mx.random.seed(seed)
    model = Eagle3DraftModel(Eagle3Config.from_dict(config))
    if embed is not None:
        model.embed_tokens.weight = embed
    if model.d2t is not None:
        model.d2t = mx.array(vocab_ids, mx.int32) - mx.arange(len(vocab_ids), dtype=mx.int32)
    evaluate_all(model)
    return model


def save_tiny_eagle3(path: str | Path, config: dict | None = None, vocab_ids: list[int] | None = None,
                     seed: int = 0, embed: mx.array | None = None) -> Path:
    """Write a tiny EAGLE-3 folder (config.json, model.safetensors with int64 d2t and bool t2d)."""
    config = config or tiny_eagle3_config()
    width = config["transformer_layer_config"]["vocab_size"]
    vocab_ids = vocab_ids or draft_vocabulary(config["draft_vocab_size"], width)
    weights = dict(tree_flatten(reference_eagle3(config, vocab_ids, seed, embed).parameters()))
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int64)
        weights["t2d"] = mx.zeros((width,), mx.bool_).at[mx.array(vocab_ids)].add(True)
    return write_folder(path, config, weights)


# ---------------------------------------------------------------------------------------
# DSpark (Gemma 4), DeepSpec's native packaging
# ---------------------------------------------------------------------------------------


def tiny_dspark_config(target_config: dict | None = None, *, proposal: int = 7, k_eq_v: bool = False,
                       taps=(1, 3, 5), **overrides) -> dict:
    """A Gemma 4 DSpark config.json for the tiny Gemma 4 target: 2 full-attention layers
    (head size 64 there, one global K/V head), proposals of `proposal` tokens, a rank-8
    Markov head and a confidence head."""
    target = target_config or tiny_gemma4_config()
    config = dict(
        architectures=["Gemma4DSparkModel"],
        model_type="gemma4_text",
        hidden_size=target["hidden_size"],
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        vocab_size=target["vocab_size"],
        max_position_embeddings=4096,
        final_logit_softcapping=target.get("final_logit_softcapping"),
        tie_word_embeddings=False,
        sliding_window=target.get("sliding_window", WINDOW),
        layer_types=["full_attention", "full_attention"],
        rope_parameters=target["rope_parameters"],
        block_size=proposal,
        mask_token_id=MASK_ID,
        target_layer_ids=list(taps),
        num_target_layers=target["num_hidden_layers"],
        markov_rank=8,
        enable_confidence_head=True,
    )
    config.update(overrides)
    return config


def reference_dspark(config: dict, seed: int = 0):
    """mlx-vlm's Gemma 4 DSpark draft for `config` (K ≠ V only), random weights (seeded)."""
    return reference_model(Gemma4DSparkDraftModel, Gemma4DsparkConfig, config, seed)


def save_tiny_dspark(path: str | Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write a tiny Gemma 4 DSpark folder; with `attention_k_eq_v` the full layers' `v_proj`
    is left out, as in the released drafts."""
    config = config or tiny_dspark_config()
    weights = dict(tree_flatten(reference_dspark({**config, "attention_k_eq_v": False}, seed).parameters()))
    if config.get("attention_k_eq_v"):
        weights = {k: v for k, v in weights.items() if ".v_proj." not in k}
    return write_folder(path, config, weights)


# ---------------------------------------------------------------------------------------
# DSpark in SpecForge's packaging (Qwen 3 backbone, the target's embedding and head)
# ---------------------------------------------------------------------------------------


def tiny_specforge_dspark_config(target_config: dict | None = None, *, proposal: int = 7, taps=(1, 3, 5),
                                 **overrides) -> dict:
    """A SpecForge DSpark config.json for the tiny Gemma 4 target: DFlash's tiny Qwen 3
    backbone (sliding, full), proposals of `proposal` tokens (`block_size`, anchor not
    counted, as mlx-vlm reads it), a rank-8 Markov head and a confidence head."""
    config = tiny_dflash_config(target_config, block_size=proposal, taps=taps)
    config.update(architectures=["DSparkDraftModel"], hidden_act="silu")
    config["dflash_config"] = dict(config["dflash_config"], projector_type="dspark", markov_rank=8,
                                   markov_head_type="vanilla", enable_confidence_head=True,
                                   confidence_head_with_markov=True)
    config.update(overrides)
    return config


def reference_specforge_dspark(config: dict, seed: int = 0) -> DSparkDraftModel:
    """mlx-vlm's (Qwen 3) DSpark draft for `config`, random weights (seeded)."""
    return reference_model(DSparkDraftModel, DSparkConfig, config, seed)


def save_tiny_specforge_dspark(path: str | Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write a tiny SpecForge DSpark folder (no embedding or head: the target's are used)."""
    config = config or tiny_specforge_dspark_config()
    return write_folder(path, config, dict(tree_flatten(reference_specforge_dspark(config, seed).parameters())))


# ---------------------------------------------------------------------------------------
# DSpark in vLLM's speculators packaging (Gemma 4 backbone, reduced vocabulary)
# ---------------------------------------------------------------------------------------

DSPARK_TOP_LEVEL = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
                    "enable_confidence_head", "architectures")


def tiny_speculators_dspark_config(target_config: dict | None = None, *, rows: int = 8, draft_vocab: int | None = None,
                                   k_eq_v: bool = True, taps=(1, 3, 5), **overrides) -> dict:
    """A speculators DSpark config.json for the tiny Gemma 4 target: the Gemma 4 layers of
    `tiny_dspark_config` as `transformer_layer_config`, query blocks of `rows` rows (the
    anchor a bonus token: rows − 1 proposals), aux hidden states at taps + 1, a draft
    vocabulary of `draft_vocab` ids (None: the whole vocabulary)."""
    native = tiny_dspark_config(target_config, proposal=rows - 1, k_eq_v=k_eq_v, taps=taps)
    layer = {k: v for k, v in native.items() if k not in DSPARK_TOP_LEVEL}
    config = dict(
        architectures=["DSparkSpeculator"],
        speculators_model_type="dspark",
        speculators_config={"algorithm": "dspark",
                            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": rows - 1}],
                            "verifier": {"architectures": ["Gemma4ForCausalLM"]}},
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab or layer["vocab_size"],
        target_hidden_size=layer["hidden_size"],
        aux_hidden_state_layer_ids=[t + 1 for t in taps],
        mask_token_id=MASK_ID,
        block_size=rows,
        markov_rank=8,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    config.update(overrides)
    return config


def speculators_as_native(config: dict) -> dict:
    """The DeepSpec-native config a speculators DSpark config amounts to over the whole
    vocabulary (K ≠ V: mlx-vlm's class cannot be built otherwise), for mlx-vlm's class."""
    layer = config["transformer_layer_config"]
    bonus = not config.get("sample_from_anchor", False)
    return dict(layer, architectures=["Gemma4DSparkModel"], attention_k_eq_v=False,
                block_size=config["block_size"] - int(bonus), sample_from_anchor=not bonus,
                mask_token_id=config["mask_token_id"],
                target_layer_ids=[i - 1 for i in config["aux_hidden_state_layer_ids"]],
                num_target_layers=max(config["aux_hidden_state_layer_ids"]) + 1,
                markov_rank=config["markov_rank"], enable_confidence_head=config["enable_confidence_head"],
                confidence_head_with_markov=config["confidence_head_with_markov"])


def save_tiny_speculators_dspark(path: str | Path, config: dict | None = None, vocab_ids: list[int] | None = None,
                                 seed: int = 0) -> Path:
    """Write a tiny speculators DSpark folder: mlx-vlm's Gemma 4 class's weights for
    `speculators_as_native(config)`, lm_head and markov_w2 cut to the rows of `vocab_ids`
    (the draft vocabulary, ascending), int64 `d2t` and bool `t2d`; no `v_proj` with K = V."""
    config = config or tiny_speculators_dspark_config()
    width = config["transformer_layer_config"]["vocab_size"]
    weights = dict(tree_flatten(reference_dspark(speculators_as_native(config), seed).parameters()))
    if config["draft_vocab_size"] < width:
        vocab_ids = vocab_ids or draft_vocabulary(config["draft_vocab_size"], width)
        rows = mx.array(vocab_ids)
        for key in ("lm_head.weight", "markov_head.markov_w2.weight"):
            weights[key] = weights[key][rows]
        weights["d2t"] = (rows - mx.arange(len(vocab_ids))).astype(mx.int64)
        weights["t2d"] = mx.zeros((width,), mx.bool_).at[rows].add(True)
    if config["transformer_layer_config"].get("attention_k_eq_v"):
        weights = {k: v for k, v in weights.items() if ".v_proj." not in k}
    return write_folder(path, config, weights)


# ---------------------------------------------------------------------------------------
# DFlash 2
# ---------------------------------------------------------------------------------------

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def tiny_dflash2_config(target_config: dict | None = None, *, block_size: int = 8, taps=(1, 3, 5),
                        **overrides) -> dict:
    """A DFlash 2 config.json for the tiny Gemma 4 target: DFlash's tiny backbone, two-tap
    convolutions over groups of 16 channels, a rank-8 selector over the top 6 candidates,
    embeddings scaled by 0.05 (at the target's own scale, √H, every row stays near the
    mask token's embedding and drafts it) and logits by 0.8."""
    config = tiny_dflash_config(target_config, block_size=block_size, taps=taps)
    config.update(architectures=["DFlash2DraftModel"], hidden_act="silu")
    config["dflash_config"] = dict(config["dflash_config"], conv_kernel_size=2, conv_group_size=16,
                                   selector_rank=8, selector_top_k=6, input_embedding_scale=0.05,
                                   output_multiplier=0.8)
    config.update(overrides)
    return config


def reference_dflash2(config: dict, seed: int = 0) -> DFlash2DraftModel:
    """mlx-vlm's DFlash 2 draft for `config`, random weights (seeded), base kernels included
    and the selector's projection scaled up."""
    model = reference_model(DFlash2DraftModel, DFlash2Config, config, seed)
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = 0.3 * mx.random.normal(conv.base_kernel.shape)
    selector = model.candidate_selector  # lattice terms as large as the logits' spread, so they matter
    selector.hidden_projection.weight = 4 * selector.hidden_projection.weight
    evaluate_all(model)
    return model


def save_tiny_dflash2(path: str | Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write a tiny DFlash 2 folder, the codebooks without `.weight` as released."""
    config = config or tiny_dflash2_config()
    weights = dict(tree_flatten(reference_dflash2(config, seed).parameters()))
    for name in CODEBOOKS:
        weights[name] = weights.pop(f"{name}.weight")
    return write_folder(path, config, weights)
