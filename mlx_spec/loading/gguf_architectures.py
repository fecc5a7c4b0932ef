"""How llama.cpp's GGUF architectures map onto mlx-lm models: the config.json each one's
metadata makes, the mlx-lm parameter each GGUF tensor is, and the norms whose stored weights
are shifted.

Architectures: Gemma 3, Gemma 4 (`gemma4`: sliding/full layer pattern, K = V full layers,
KV-shared layers, per-layer inputs) and Gemma 4's MTP assistant (`gemma4-assistant`), as
llama.cpp's `convert_hf_to_gguf.py` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading.chat_templates import GEMMA4_CHAT_TEMPLATE, GEMMA_CHAT_TEMPLATE
from mlx_spec.models import gemma4_assistant


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps onto an mlx-lm model.

    Attributes:
        config: (GGUF metadata, tensor shapes, tensor reader) -> mlx-lm config.json.
        norm_offset: subtracted from every RMSNorm weight; llama.cpp stores Gemma 3's
            `1 + w` while mlx-lm's Gemma 3 RMSNorm multiplies by `1 + w` itself (Gemma 4
            norms multiply by the plain weight: 0).
        norm_class: name of the mlx-lm module class whose weights get the offset.
        chat_template: fallback when the file carries none.
        names: the gguf package's architecture whose tensor-name map applies.
        extra_names: mlx parameter -> GGUF tensor, for tensors that map lacks.
    """

    config: Callable[[dict, dict, Callable], dict]
    norm_offset: float
    norm_class: str
    chat_template: str | None
    names: str
    extra_names: dict = field(default_factory=dict)


def _gemma3_config(meta: dict, shapes: dict, read) -> dict:
    def get(key, default=None):
        return meta.get(f"gemma3.{key}", default)

    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    head_dim = get("attention.key_length", hidden // heads)
    tokens = meta["tokenizer.ggml.tokens"]
    eos = [meta.get("tokenizer.ggml.eos_token_id", 1)]
    if "<end_of_turn>" in tokens:  # Gemma chat turns end with it (id 106)
        eos.append(tokens.index("<end_of_turn>"))
    config = dict(
        model_type="gemma3_text",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_round(get("attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=shapes["token_embd.weight"][0],
        rope_theta=_round(get("rope.freq_base", 1_000_000.0)),
        max_position_embeddings=get("context_length", 32768),
        sliding_window=get("attention.sliding_window", 512),
        # Not stored in GGUF; the same for every Gemma 3 size (HF configs).
        rope_local_base_freq=10_000.0,
        sliding_window_pattern=6,
        # Gemma 3 27B (62 layers) scales queries by hidden/heads = 168, every other size by
        # head_dim = 256; llama.cpp hard-codes the same rule.
        query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        eos_token_id=eos,
        tie_word_embeddings="output.weight" not in shapes,
    )
    if get("rope.scaling.type") == "linear":  # 4B and larger: global layers use factor 8
        config["rope_scaling"] = {"rope_type": "linear", "factor": _round(get("rope.scaling.factor"))}
    return config


def _gemma4_text_config(meta: dict, shapes: dict, read, prefix: str) -> dict:
    """The `gemma4_text` fields llama.cpp's converter keeps (conversion/gemma.py, Gemma4Model)."""
    def get(key, default=None):
        return meta.get(f"{prefix}.{key}", default)

    if any(".ffn_gate_inp." in name for name in shapes):
        raise ValueError("mixture-of-experts layers (26B-A4B) are not supported yet")
    layers = get("block_count")
    sliding = get("attention.sliding_window_pattern")
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    first_shared = layers - get("attention.shared_kv_layers", 0)
    # Per-layer lists where sliding and full layers differ; a scalar where they do not.
    kv_heads = get("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    feed_forward = get("feed_forward_length")
    feed_forward = feed_forward if isinstance(feed_forward, list) else [feed_forward] * layers
    intermediate = feed_forward[0]
    double_wide = [intermediate * (2 if i >= first_shared else 1) for i in range(layers)]
    if feed_forward not in ([intermediate] * layers, double_wide):
        raise ValueError(f"per-layer feed-forward sizes {feed_forward} are not supported")
    full = layer_types.index("full_attention")
    head_dim, global_head_dim = get("attention.key_length_swa"), get("attention.key_length")
    # The full layers' partial RoPE is written as frequency factors: 1 for each rotated
    # pair, 1e30 (no rotation) for the rest.
    factors = read("rope_freqs.weight") if "rope_freqs.weight" in shapes else None
    rotated = int((factors < 1e10).sum()) if factors is not None else global_head_dim // 2
    per_layer = get("embedding_length_per_layer_input", 0)
    return dict(
        model_type="gemma4_text",
        hidden_size=get("embedding_length"),
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        use_double_wide_mlp=feed_forward != [intermediate] * layers,
        num_attention_heads=get("attention.head_count"),
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_key_value_heads=kv_heads[layer_types.index("sliding_attention")],
        num_global_key_value_heads=kv_heads[full],
        # K = V: a full layer that has keys but no value projection uses its keys as values
        attention_k_eq_v=(f"blk.{full}.attn_k.weight" in shapes
                          and f"blk.{full}.attn_v.weight" not in shapes),
        num_kv_shared_layers=layers - first_shared,
        hidden_size_per_layer_input=per_layer,
        vocab_size=shapes["token_embd.weight"][0],
        vocab_size_per_layer_input=shapes["per_layer_token_embd.weight"][0] if per_layer else 0,
        rms_norm_eps=_round(get("attention.layer_norm_rms_epsilon", 1e-6)),
        sliding_window=get("attention.sliding_window"),
        layer_types=layer_types,
        max_position_embeddings=get("context_length", 131072),
        final_logit_softcapping=_round(get("final_logit_softcapping")),
        enable_moe_block=False,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "full_attention": {"partial_rotary_factor": _round(rotated / (global_head_dim // 2)),
                               "rope_theta": _round(get("rope.freq_base", 1_000_000.0)),
                               "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": _round(get("rope.dimension_count_swa", head_dim)
                                                                  / head_dim),
                                  "rope_theta": _round(get("rope.freq_base_swa", 10_000.0)),
                                  "rope_type": "default"},
        },
        tie_word_embeddings="output.weight" not in shapes,
    )


def _gemma4_config(meta: dict, shapes: dict, read) -> dict:
    config = _gemma4_text_config(meta, shapes, read, "gemma4")
    config["eos_token_id"] = [meta.get("tokenizer.ggml.eos_token_id", 1)]  # + <turn|>: tokenizer_loading
    return config


def _gemma4_assistant_config(meta: dict, shapes: dict, read) -> dict:
    """The assistant's config in the released checkpoints' schema (gemma4_assistant). The
    converter drops the centroid head of E2B/E4B assistants, so their GGUFs draft with the
    dense tied head, as llama.cpp does; a file that has the centroids keeps them."""
    text = _gemma4_text_config(meta, shapes, read, "gemma4-assistant")
    centroids = "masked_embd_centroids.weight" in shapes
    config = dict(
        model_type="gemma4_assistant" if centroids else "gemma4_unified_assistant",
        backbone_hidden_size=meta["gemma4-assistant.embedding_length_out"],
        use_ordered_embeddings=centroids,
        tie_word_embeddings=True,
        text_config=text,
    )
    if centroids:
        config["num_centroids"] = shapes["masked_embd_centroids.weight"][0]
    return config


ARCHITECTURES = {
    "gemma3": GGUFArchitecture(_gemma3_config, 1.0, "RMSNorm", GEMMA_CHAT_TEMPLATE, "gemma3"),
    "gemma4": GGUFArchitecture(_gemma4_config, 0.0, "RMSNorm", GEMMA4_CHAT_TEMPLATE, "gemma4"),
    "gemma4-assistant": GGUFArchitecture(
        _gemma4_assistant_config, 0.0, "RMSNorm", None, "gemma4",
        extra_names={"pre_projection.weight": "nextn.pre_projection.weight",
                     "post_projection.weight": "nextn.post_projection.weight",
                     "masked_embedding.centroids.weight": "masked_embd_centroids.weight",
                     "masked_embedding.token_ordering": "masked_embd_ordering"}),
}


def skeleton(config: dict):
    """The mlx-lm model for `config` (our class for an MTP assistant), parameters
    unevaluated: only names, shapes and module types are used."""
    model_class, args_class = gemma4_assistant.assistant_classes(config)
    model = model_class(args_class.from_dict(config))
    if config.get("tie_word_embeddings") and hasattr(model, "sanitize") \
            and not gemma4_assistant.is_assistant_config(config):
        model.sanitize({})  # no lm_head weight: the model ties it to the embedding
    return model


def gguf_names(arch: GGUFArchitecture, model, n_layers: int, shapes: dict) -> dict:
    """mlx-lm parameter name -> (GGUF tensor name, expected shape), via gguf's own name map
    (and `arch.extra_names`). A parameter without a suffix (Gemma 4's `layer_scalar`) is
    stored with ".weight" appended, as llama.cpp's converter does."""
    import gguf
    from mlx.utils import tree_flatten

    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch.names]
    name_map = gguf.get_tensor_name_map(arch_id, n_layers)
    names = {}
    for mlx_name, param in tree_flatten(model.parameters()):
        gguf_name = arch.extra_names.get(mlx_name) or name_map.get_name(mlx_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelLoadError(f"no GGUF tensor name known for mlx-lm parameter {mlx_name}")
        if gguf_name not in shapes and f"{gguf_name}.weight" in shapes:
            gguf_name = f"{gguf_name}.weight"
        names[mlx_name] = (gguf_name, tuple(param.shape))
    return names


def norm_parameters(model, class_name: str) -> set[str]:
    """The weights of the model's `class_name` modules: those `norm_offset` applies to."""
    return {f"{path}.weight" for path, module in model.named_modules()
            if type(module).__name__ == class_name}


def _round(value):
    """GGUF stores floats as f32; 9.999999974752427e-07 reads better as 1e-06."""
    return float(f"{float(value):.7g}") if value is not None else None
