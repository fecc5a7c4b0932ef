"""Gemma 4's multi-token-prediction assistant (`gemma4_assistant`, `gemma4_unified_assistant`).

A 4-layer, query-only decoder with no cache of its own: every layer attends to the
*target's* keys and values, those of the target's last non-KV-shared layer of the same
attention type. One step:

    x   = pre_projection(concat(E_target[token] · √H_target, h))   [2·H_target -> H]
    h_d = norm(layers(x))        sliding, sliding, sliding, full; scale 1.0, plain-weight norms
    logits = h_d @ embed_tokensᵀ  (dense: 12B, 26B, 31B)  or the centroid head (E2B, E4B)
    h'  = post_projection(h_d)   the next step's h             [H -> H_target]

The layers are mlx-lm's own `gemma4_text.DecoderLayer` (query projection and norm, RoPE with
the "proportional" variant on the full layer, attention, gelu-tanh MLP, layer scalar), built
with every layer KV-shared so they carry no key or value projections. Key names are those of
the released checkpoints (HF `Gemma4AssistantForCausalLM`), so their safetensors load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.base import BaseModelArgs

from mlx_spec.core.cache.forward import text_model
from mlx_spec.core.cache.layers import QuantizedKVReader

MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma4_assistant"
    text_config: dict = field(default_factory=dict)
    backbone_hidden_size: int = 1536  # the target's hidden size
    use_ordered_embeddings: bool = False  # the centroid head (E2B/E4B)
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True


def text_args(text_config: dict) -> gemma4_text.ModelArgs:
    """mlx-lm Gemma 4 layer arguments for the assistant: every layer KV-shared (query-only),
    no per-layer inputs, MoE or double-wide MLP, whatever defaults a config leaves out."""
    config = dict(text_config)
    config.update(
        num_kv_shared_layers=config["num_hidden_layers"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=False,
        final_logit_softcapping=None,
    )
    return gemma4_text.ModelArgs.from_dict(config)


class MaskedEmbedding(nn.Module):
    """The centroid head: score `num_centroids` clusters, keep the top k, and give real
    logits only to the tokens of those clusters (`token_ordering` lists each cluster's
    vocab_size / num_centroids token ids); every other token gets the smallest real logit
    minus 1, as the reference does."""

    def __init__(self, args: ModelArgs, hidden_size: int, vocab_size: int):
        super().__init__()
        self.top_k = args.centroid_intermediate_top_k
        self.num_centroids = args.num_centroids
        self.centroids = nn.Linear(hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab_size,), dtype=mx.int32)

    def candidates(self, h: mx.array, embed: nn.Module) -> tuple[mx.array, mx.array]:
        """Candidate ids [..., top_k·V/C] and their logits, for h [..., H]."""
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        ids = self.token_ordering.reshape(self.num_centroids, -1)[top]  # [..., k, V/C]
        ids = ids.reshape(*h.shape[:-1], -1)
        # embed(ids) rather than embed.weight[ids]: a quantized embedding dequantizes its rows
        rows = embed(ids)  # [..., N, H]
        return ids, (rows @ h[..., None])[..., 0]

    def __call__(self, h: mx.array, embed: nn.Module, vocab_size: int) -> mx.array:
        ids, logits = self.candidates(h, embed)
        out = mx.full((*h.shape[:-1], vocab_size), logits.min() - 1.0, dtype=logits.dtype)
        return mx.put_along_axis(out, ids, logits, axis=-1)

    def argmax(self, h: mx.array, embed: nn.Module) -> mx.array:
        ids, logits = self.candidates(h, embed)
        return mx.take_along_axis(ids, mx.argmax(logits, axis=-1)[..., None], axis=-1)[..., 0]


class AssistantTextModel(nn.Module):
    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)  # the tied head
        self.layers = [gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, shared_kv: dict, position, masks: Optional[dict] = None) -> mx.array:
        for layer in self.layers:
            mask = None if masks is None else masks[layer.layer_type]
            kv = shared_kv[layer.layer_type]
            # quantized target K/V: a reader makes attention use mx.quantized_matmul on them
            reader = QuantizedKVReader.for_keys(kv[0], layer.self_attn.head_dim)
            x, _, _ = layer(x, mask, reader, shared_kv=kv, offset=position)
        return self.norm(x)


class Model(nn.Module):
    """The assistant. `model(inputs_embeds, shared_kv, position)` returns (logits, h')."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.text_args = text_args(args.text_config)
        hidden, vocab = self.text_args.hidden_size, self.text_args.vocab_size
        self.vocab_size = vocab
        self.model = AssistantTextModel(self.text_args)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, args.backbone_hidden_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args, hidden, vocab)

    @property
    def layers(self):
        return self.model.layers

    def hidden(self, inputs_embeds: mx.array, shared_kv: dict, position,
               masks: Optional[dict] = None) -> mx.array:
        """h_d [B, L, H] for inputs [B, L, 2·H_target].

        Args:
            shared_kv: {"sliding_attention": (keys, values), "full_attention": (keys, values)},
                each [B, kv_heads, S, head_dim] as the target's cache holds them; every key
                given is attended to unless `masks` says otherwise.
            position: the query's RoPE position (an int, or an array [B], one per row).
            masks: optional attention masks per layer type (for training on many positions).
        """
        return self.model(self.pre_projection(inputs_embeds), shared_kv, position, masks)

    def logits(self, h_d: mx.array) -> mx.array:
        if self.args.use_ordered_embeddings:
            return self.masked_embedding(h_d, self.model.embed_tokens, self.vocab_size)
        return self.model.embed_tokens.as_linear(h_d)

    def greedy(self, h_d: mx.array) -> mx.array:
        """argmax of `logits(h_d)` without building the full-vocabulary row."""
        if self.args.use_ordered_embeddings:
            return self.masked_embedding.argmax(h_d, self.model.embed_tokens)
        return mx.argmax(self.model.embed_tokens.as_linear(h_d), axis=-1)

    def __call__(self, inputs_embeds: mx.array, shared_kv: dict, position) -> tuple[mx.array, mx.array]:
        h_d = self.hidden(inputs_embeds, shared_kv, position)
        return self.logits(h_d), self.post_projection(h_d)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for key, value in weights.items():
            if key == "lm_head.weight" and self.args.tie_word_embeddings:
                continue  # tied to model.embed_tokens
            if "rotary_emb" in key or key.endswith("embed_scale"):
                continue  # buffers recomputed here
            if key == "masked_embedding.token_ordering":
                value = value.astype(mx.int32)  # stored as int64; ids fit in 32 bits
            out[key] = value
        return out

    @property
    def quant_predicate(self):
        # The centroid scores pick which tokens get logits at all: keep them exact.
        return lambda path, module: not path.startswith("masked_embedding")


def is_assistant_config(config: dict) -> bool:
    return config.get("model_type") in MODEL_TYPES


def assistant_classes(config: dict):
    """For mlx-lm's loader (`get_model_classes`): our classes for assistant checkpoints."""
    if is_assistant_config(config):
        return Model, ModelArgs
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def last_kv_layers(args: gemma4_text.ModelArgs) -> dict[str, int]:
    """The target's last non-KV-shared layer of each attention type: the layers whose K/V
    the assistant attends to (for the 12B target, 46 and 47 of 48)."""
    first_shared = args.num_hidden_layers - args.num_kv_shared_layers
    return {args.layer_types[i]: i for i in range(first_shared)}


def target_text_model(target) -> Optional[nn.Module]:
    """The inner `gemma4_text` model of a Gemma 4 target (text-only or multimodal build),
    or None for other architectures."""
    inner = getattr(text_model(target), "model", None)
    if isinstance(inner, gemma4_text.Gemma4TextModel):
        return inner
    return None

