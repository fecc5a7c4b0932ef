"""EAGLE-3 (speculators format): a one-layer draft over three of the target's layers, with a
reduced draft vocabulary.

    g     = fc(concat(target states at the three aux layers))                 [H_target·3 -> H]
    layer 0 (position p): attention over concat(input_layernorm(E[x_p+1]), hidden_norm(g_p))
          [2·H in], residual hidden_norm(g_p) if norm_before_residual else g_p; MLP with
          the layer config's `hidden_act`
    h_p   = the layer stack's output (pre-norm); logits = lm_head(norm(h_p)) over the draft
          vocabulary; draft id d is target id d + d2t[d]

Entry p of the draft's own cache pairs the target's state at position p with the token at
p + 1 (RoPE at p + 1). Later draft steps feed the draft's own h in g's place (it skips fc).

Packaging (vLLM speculators): no top-level `model_type`; `speculators_model_type: "eagle3"`,
`speculators_config`, `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids` (HF hidden-state indices: id i is the input of target
layer i, the output of layer i − 1), `norm_before_residual`, and a Llama
`transformer_layer_config`. Weights: `embed_tokens`, `fc`, `layers.0.*`, `norm`, `lm_head`,
`d2t` (int64 offsets), `t2d` (bool; not needed to draft).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from mlx_spec.core.cache.forward import text_model
from mlx_spec.core.passes import pad_left
from mlx_spec.models.draft_layers import GatedMLP, drafting_weights

ACTIVATIONS = {"silu": nn.silu, "swish": nn.silu, "gelu": nn.gelu, "gelu_new": nn.gelu_approx,
               "gelu_pytorch_tanh": nn.gelu_approx, "gelu_approx": nn.gelu_approx}


def is_eagle3_config(config: dict) -> bool:
    speculators = config.get("speculators_config") or {}
    return (config.get("speculators_model_type") == "eagle3" or speculators.get("algorithm") == "eagle3"
            or "Eagle3Speculator" in (config.get("architectures") or ()))


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list
    norm_before_residual: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    speculative_tokens: int = 3
    model_type: str = "eagle3"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        layer = config["transformer_layer_config"]
        rope = layer.get("rope_parameters") or {}
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        hidden = layer["hidden_size"]
        return cls(
            hidden_size=hidden,
            intermediate_size=layer["intermediate_size"],
            num_hidden_layers=layer.get("num_hidden_layers", 1),
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
            head_dim=layer.get("head_dim") or hidden // layer["num_attention_heads"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=config.get("draft_vocab_size", layer["vocab_size"]),
            target_hidden_size=config.get("target_hidden_size") or hidden,
            aux_layer_ids=list(config.get("eagle_aux_hidden_state_layer_ids") or []),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10_000.0))),
            hidden_act=layer.get("hidden_act", "silu"),
            attention_bias=bool(layer.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            speculative_tokens=int(methods[0].get("speculative_tokens", 3)),
        )

    @property
    def tap_layers(self) -> tuple:
        """The target decoder layers whose outputs are the aux hidden states (id i is the
        input of layer i: layer i − 1's output)."""
        return tuple(i - 1 for i in self.aux_layer_ids)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, input_size: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(input_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, args.hidden_size, bias=bias)
        self.rope = nn.RoPE(self.head_dim, base=args.rope_theta)

    def __call__(self, x: mx.array, mask, cache: KVCache, offset: int) -> mx.array:
        B, L, _ = x.shape
        queries = self.rope(self.q_proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3), offset=offset)
        keys = self.rope(self.k_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3), offset=offset)
        values = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def rows(self, x: mx.array, caches: list, offsets: mx.array) -> mx.array:
        """One token per row (x [B, 1, ·]), row i into its own `caches[i]` at RoPE
        `offsets[i]`: the projections as one call, each row attending to its own keys
        (left-padded to the longest row's, the padding masked)."""
        B, L, _ = x.shape
        queries = self.rope(self.q_proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3), offset=offsets)
        keys = self.rope(self.k_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3), offset=offsets)
        values = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        rows = [cache.update_and_fetch(keys[i : i + 1], values[i : i + 1]) for i, cache in enumerate(caches)]
        lengths = [k.shape[2] for k, _ in rows]
        width = max(lengths)
        keys, values = (mx.concatenate([pad_left(kv[j], width, 2) for kv in rows]) for j in (0, 1))
        first = mx.array([width - n for n in lengths])[:, None]
        mask = (mx.arange(width)[None] >= first)[:, None, None]  # [B, 1, 1, keys]
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def layer_mlp(args: ModelArgs) -> GatedMLP:
    """The layer config's gated MLP, with its `hidden_act`."""
    if args.hidden_act not in ACTIVATIONS:
        raise ValueError(f"EAGLE-3 hidden_act {args.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
    return GatedMLP(args.hidden_size, args.intermediate_size, ACTIVATIONS[args.hidden_act])


class Layer(nn.Module):
    """A decoder layer; the first takes concat(input_layernorm(embedding), hidden_norm(g))."""

    def __init__(self, args: ModelArgs, first: bool):
        super().__init__()
        self.first, self.norm_before_residual = first, args.norm_before_residual
        H = args.hidden_size
        self.input_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if first:
            self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.self_attn = Attention(args, 2 * H if first else H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.mlp = layer_mlp(args)

    def __call__(self, h: mx.array, embeds: Optional[mx.array], mask, cache, offset, rows: bool = False) -> mx.array:
        """`rows`: one token per row, each into its own cache (`cache` a list, `offset` [B])."""
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        else:
            residual, x = h, self.input_layernorm(h)
        attended = self.self_attn.rows(x, cache, offset) if rows else self.self_attn(x, mask, cache, offset)
        h = residual + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = "eagle3"
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.fc = nn.Linear(len(args.aux_layer_ids) * args.target_hidden_size, args.hidden_size, bias=False)
        self.layers = [Layer(args, i == 0) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.draft_vocab_size, bias=False)
        if args.draft_vocab_size != args.vocab_size:
            self.d2t = mx.zeros((args.draft_vocab_size,), mx.int32)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def hidden(self, tokens: mx.array, g: mx.array, cache: list, offset: int, taps: bool) -> mx.array:
        """h [1, L, H] for tokens [1, L] (the token after each state) and states g: the
        target's taps [1, L, k·H_target] (taps: through fc) or the draft's own h [1, L, H]."""
        if taps:
            g = self.fc(g)
        embeds = self.embed_tokens(tokens)
        h = g
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, embeds, create_attention_mask(h, layer_cache), layer_cache, offset)
        return h

    def step_rows(self, tokens: mx.array, h: mx.array, caches: list, offsets: list[int]) -> mx.array:
        """Draft steps of B requests in one call: h [B, 1, H] for tokens [B, 1] after each
        row's own h [B, 1, H], row i into its caches `caches[i]` at RoPE `offsets[i]`."""
        embeds = self.embed_tokens(tokens)
        positions = mx.array(offsets, mx.int32)
        for i, layer in enumerate(self.layers):
            h = layer(h, embeds, None, [row[i] for row in caches], positions, rows=True)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(h))

    def target_ids(self) -> mx.array:
        """[draft vocabulary] the target id of each draft id."""
        ids = mx.arange(self.args.draft_vocab_size, dtype=mx.int32)
        return ids + self.d2t if "d2t" in self else ids

    def step_timer(self, target, context: int) -> Callable[[], None]:
        """One draft step after `context` positions of its own cache (zeros: a step's cost
        depends on how many keys it attends to), for the cost curve."""
        cache = self.make_cache()
        H = self.args.hidden_size
        self.hidden(mx.zeros((1, context), mx.int32), mx.zeros((1, context, H)), cache, 1, taps=False)
        mx.eval([c.state for c in cache])
        token, h = mx.array([[10]]), mx.zeros((1, 1, H))

        def run():
            mx.eval(self.logits(self.hidden(token, h, cache, context + 1, taps=False)))
            for c in cache:
                c.trim(1)

        return run

    def sanitize(self, weights: dict) -> dict:
        return drafting_weights(weights)


def target_mismatch(args: ModelArgs, target) -> Optional[str]:
    """Why an EAGLE-3 draft built with `args` cannot draft for `target` (None: it can)."""
    inner = text_model(target).model
    hidden = inner.embed_tokens(mx.array([0])).shape[-1]
    vocab = inner.embed_tokens.weight.shape[0]
    depth = len(inner.layers)
    if args.target_hidden_size != hidden:
        return f"the EAGLE-3 draft was built for a target of hidden size {args.target_hidden_size}; this target's is {hidden}"
    if args.vocab_size != vocab:
        return f"the EAGLE-3 draft was built for a vocabulary of {args.vocab_size}; this target's has {vocab}"
    bad = [i for i in args.aux_layer_ids if not 1 <= i <= depth]
    if bad or len(args.aux_layer_ids) == 0:
        return (f"the EAGLE-3 draft reads target hidden states {args.aux_layer_ids}; this target has "
                f"{depth} layers (states 1..{depth} can be read)")
    return None
