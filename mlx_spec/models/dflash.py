"""DFlash (z-lab; arXiv 2602.06036): a block-diffusion draft over the target's tap layers.

The draft has no embedding or head of its own. One forward drafts a whole block:

    ctx   = hidden_norm(fc(concat(target layer outputs at `target_layer_ids`)))   [S, H]
    x     = E_target[last, mask, mask, …] · embed_scale                          [block_size, H]
    layer: q from x; keys and values from [ctx ; x] (k_norm on keys, RoPE by position);
           no causal mask (every block row sees every context and block position);
           sliding layers see the newest window − 1 context positions
    logits = target_head(norm(x)) at rows 1..block_size−1: the block's draft positions

Context keys and values depend only on the target's states, so they are kept (`Context`)
and only the positions committed since are projected each round; the block's own keys are
never kept. The backbone is Qwen3's (q/k norms, SwiGLU MLP). Weights are read under the
z-lab names (`fc`, `hidden_norm`, `layers.N.self_attn.q_proj`, … , `norm`).

Packaging: config.json with `dflash_config` {block_size, target_layer_ids, mask_token_id}
(block_size may sit at the top level instead), `model_type: qwen3` (any), transformers-5
`rope_parameters` with no top-level `rope_theta`, `layer_types` and `sliding_window`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from mlx_spec.core.cache.forward import text_model
from mlx_spec.models.draft_layers import GatedMLP


def is_dflash_config(config: dict) -> bool:
    """A DFlash draft's config.json (not DFlash 2, not a DSpark packaged as DFlash)."""
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        return False
    if "DFlash2DraftModel" in (config.get("architectures") or ()):
        return False
    return dflash.get("projector_type") != "dspark" and not int(config.get("markov_rank") or
                                                                 dflash.get("markov_rank") or 0)


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 32768
    layer_types: list = field(default_factory=list)
    sliding_window: Optional[int] = None
    final_logit_softcapping: Optional[float] = None
    causal: bool = False
    model_type: str = "dflash"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        dflash = config["dflash_config"]
        rope = dict(config.get("rope_parameters") or {})
        theta = config.get("rope_theta", rope.pop("rope_theta", 10_000.0))
        layers = config["num_hidden_layers"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(dflash.get("block_size") or config.get("block_size") or 16),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=config.get("rope_scaling") or rope or None,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            layer_types=list(config.get("layer_types") or ["full_attention"] * layers),
            sliding_window=config.get("sliding_window"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            causal=bool(dflash.get("causal", False)),
        )


class ContextAttention(nn.Module):
    """A block's attention over its context: queries from the block rows, keys and values the
    context's (kept, `Context`) then the block's own (`keys_values`), no causal mask. A
    subclass sets heads, q_proj, q_norm, o_proj, rope, scale and `keys_values` (DFlash's
    below, DSpark's Gemma 4 one)."""

    def __call__(self, x: mx.array, context: tuple, offset, mask) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=offset)
        keys, values = self.keys_values(x, offset)
        keys = mx.concatenate([context[0], keys], axis=2)
        values = mx.concatenate([context[1], values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Attention(ContextAttention):
    def __init__(self, args: ModelArgs, sliding: bool, rope):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        self.rope = rope  # the model's one RoPE
        # the context rows a block sees on this layer (None: all)
        self.window = args.sliding_window - 1 if sliding and args.sliding_window else None
        self.q_proj = nn.Linear(args.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """Keys (normed, RoPE at `offset` on) and values [B, kv_heads, L, head_dim] of x [B, L, H]."""
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(keys, offset=offset), values


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int, rope):
        super().__init__()
        self.self_attn = Attention(args, args.layer_types[index] == "sliding_attention", rope)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, context, offset, mask):
        h = x + self.self_attn(self.input_layernorm(x), context, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Context:
    """One request's context keys and values in every draft layer (positions `base`..
    `length` − 1; `base` > 0 when a reused prompt cache's prefix was never projected)."""

    def __init__(self, layers: int, base: int = 0):
        self.caches = [KVCache() for _ in range(layers)]
        self.base = base

    @property
    def length(self) -> int:
        return self.base + self.caches[0].offset

    @property
    def held(self) -> int:
        """Positions whose keys it holds (none: there is nothing to draft from)."""
        return self.caches[0].offset

    def trim(self, n: int) -> None:
        for cache in self.caches:
            cache.trim(n)

    def layer(self, index: int, window: Optional[int]) -> tuple[mx.array, mx.array]:
        """Layer `index`'s context keys and values [1, kv_heads, S, head_dim]; the newest
        `window` only where given."""
        cache = self.caches[index]
        used = cache.offset
        first = 0 if window is None else max(0, used - window)
        return cache.keys[..., first:used, :], cache.values[..., first:used, :]


class BlockBackbone(nn.Module):
    """What every block draft's backbone does with `fc`, `hidden_norm`, `layers` (each with
    a `ContextAttention`) and `norm`: project the target's taps into context keys and values,
    and run a block over them."""

    def extend(self, context: Context, taps: mx.array) -> None:
        """Project the target's taps [1, n, k·H] at positions context.length.. into every
        layer's context keys and values."""
        if taps.shape[1] == 0:
            return
        h = self.hidden_norm(self.fc(taps))
        offset = context.length
        for layer, cache in zip(self.layers, context.caches):
            cache.update_and_fetch(*layer.self_attn.keys_values(h, offset))

    def hidden(self, x: mx.array, contexts: list, offset, masks: Optional[list] = None) -> mx.array:
        """Final hidden states [B, L, H] of the block embeddings x [B, L, H] after the
        per-layer context keys and values `contexts[layer]` ([B, kv_heads, S, head_dim]
        pairs), the block's first row at RoPE position `offset` (an int or one per row);
        `masks[layer]` [B, 1, 1, S + L] hides a batch's padding (None: nothing hidden)."""
        h = x
        for i, (layer, context) in enumerate(zip(self.layers, contexts)):
            h = layer(h, context, offset, None if masks is None else masks[i])
        return self.norm(h)


class Model(BlockBackbone):
    """The DFlash draft; the drafter lends it the target's embedding and head."""

    layer_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = "dflash"
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.rope = initialize_rope(args.head_dim, args.rope_theta, False, args.rope_scaling,
                                    args.max_position_embeddings)
        self.layers = [self.layer_class(args, i, self.rope) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    def step_timer(self, target, context: int) -> Callable[[], None]:
        """A round's drafting as the drafter does it, after `context` zero positions of
        context (a forward's cost depends on how many keys it attends to, not on them), for
        the cost curve (`costs.measure_costs`): the last round's two committed positions
        projected into the context, then one block forward."""
        head = TargetHead(target, self.args.final_logit_softcapping)
        block = mx.array([[self.args.mask_token_id] * self.block_size])
        return block_timer(self, context, lambda contexts, offset:
                           head.logits(self.hidden(head.embed(block), contexts, offset)))

    def sanitize(self, weights: dict) -> dict:
        return {k.removeprefix("model."): v for k, v in weights.items()}


def block_timer(model, context: int, draft: Callable[[list, int], mx.array]) -> Callable[[], None]:
    """A block draft's round for the cost curve: after `context` zero positions of context,
    the last round's two committed positions projected into it, then `draft(contexts,
    offset)`, which computes what one block forward and its drawing do (DFlash's, DFlash 2's
    and DSpark's `step_timer`)."""
    state = Context(len(model.layers))
    width = getattr(model.args, "target_hidden_size", None) or model.args.hidden_size
    taps = mx.zeros((1, context, len(model.args.target_layer_ids) * width))  # fc.weight is packed when quantized
    model.extend(state, taps)
    mx.eval([c.state for c in state.caches])

    def run():
        model.extend(state, taps[:, :2])
        contexts = [state.layer(i, layer.self_attn.window) for i, layer in enumerate(model.layers)]
        mx.eval(draft(contexts, context + 2))
        state.trim(2)

    return run


class TargetHead:
    """The target's embedding (scaled as mlx-vlm's DFlash scales it: the decoder's
    `embed_scale` where it has one) and LM head, with the draft's logit soft-cap (the
    target's where the draft names none)."""

    def __init__(self, target, softcap: Optional[float] = None):
        lm = text_model(target)
        inner = lm.model
        self.embed_tokens = inner.embed_tokens
        self.embed_scale = getattr(inner, "embed_scale", 1.0)
        tied = getattr(lm, "tie_word_embeddings", not hasattr(lm, "lm_head"))
        self.head = self.embed_tokens.as_linear if tied else lm.lm_head
        self.softcap = softcap or getattr(lm, "final_logit_softcapping", None)
        self.vocab_size = self.embed_tokens.weight.shape[0]

    def embed(self, ids: mx.array) -> mx.array:
        return self.embed_tokens(ids) * self.embed_scale

    def logits(self, hidden: mx.array) -> mx.array:
        logits = self.head(hidden)
        if self.softcap:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits


def sequence_mask(lengths: list[int], width: int, block: int) -> mx.array:
    """[B, 1, 1, width + block] True where row i's context key is real (its `lengths[i]`
    newest of `width` left-padded slots) or a block key."""
    first = mx.array([width - n for n in lengths])[:, None]
    keys = mx.arange(width + block)[None]
    return (keys >= first)[:, None, None]



def target_mismatch(args: ModelArgs, target) -> Optional[str]:
    """Why a DFlash draft built with `args` cannot draft for `target` (None: it can): its
    hidden size, vocabulary and tap layers must be the target's."""
    inner = text_model(target).model
    hidden = inner.embed_tokens(mx.array([0])).shape[-1]
    vocab = TargetHead(target).vocab_size
    depth = len(inner.layers)
    if args.hidden_size != hidden:
        return f"the DFlash draft was built for a target of hidden size {args.hidden_size}; this target's is {hidden}"
    if args.vocab_size != vocab or args.mask_token_id >= vocab:
        return (f"the DFlash draft was built for a vocabulary of {args.vocab_size} (mask token "
                f"{args.mask_token_id}); this target's has {vocab}")
    beyond = [i for i in args.target_layer_ids if not 0 <= i < depth]
    if beyond:
        return (f"the DFlash draft taps target layers {args.target_layer_ids}; this target has "
                f"{depth} layers (no layer {beyond[0]})")
    return None
