"""DSpark for Gemma 4 (`Gemma4DSparkModel`, DeepSeek DeepSpec): a block draft over the
target's tap layers, as DFlash (`mlx_spec.models.dflash`: context keys and values from
fc(taps), a block [anchor, mask, …] drafted in one non-causal forward), with:

- Gemma 4 layers: four sandwich norms, `layer_scalar`, GeGLU MLP, unit attention scale;
  full-attention layers at `global_head_dim`, and with `attention_k_eq_v` no `v_proj`:
  the values are the key projection (`num_global_key_value_heads` heads), before k_norm;
- a scale-free RMS norm on values (`v_norm`), as Gemma 4's own attention and vLLM's
  `Gemma4DSparkModel` apply it (mlx-vlm 0.7.10's DSpark applies none);
- its own embedding (scaled by √H) and LM head, with the logit soft-cap;
- a low-rank Markov head: position j's logits + markov_w2(markov_w1(previous token)),
  the previous token being the anchor for the first position and the token drawn at j − 1
  after it, so each draft token's distribution is conditioned on the one before it;
- `sample_from_anchor` (default true): the anchor's own row scores the first draft token
  (block [anchor, mask × (P − 1)]); false: block [anchor, mask × P], the anchor row dropped.
  Getting this wrong halves acceptance with no error, hence the setting is read, not assumed.

The confidence head (`confidence_head.proj`) is loaded and not used: a cut of the block
would be a stopping rule on kept tokens (exact either way); blocks are cut by γ instead.

Packaging read: DeepSpec-native, `architectures: ["Gemma4DSparkModel"]`, `model_type:
gemma4_text`, the DSpark fields flat or under `dflash_config` (`block_size`: the proposal
length, anchor not counted), per-layer-type `rope_parameters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from mlx_spec.core.cache.forward import text_model
from mlx_spec.models.dflash import Context


def is_dspark_config(config: dict) -> bool:
    """A Gemma 4 DSpark draft's config.json (the DeepSpec-native packaging)."""
    return "Gemma4DSparkModel" in (config.get("architectures") or ())


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
    proposal_length: int
    global_head_dim: Optional[int] = None
    num_global_key_value_heads: Optional[int] = None
    attention_k_eq_v: bool = False
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: list = field(default_factory=list)
    rope_parameters: dict = field(default_factory=dict)
    max_position_embeddings: int = 131072
    markov_rank: int = 256
    sample_from_anchor: bool = True
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    model_type: str = "dspark"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        nested = config.get("dflash_config")
        fields = dict(config, **nested) if isinstance(nested, dict) else config
        layers = config["num_hidden_layers"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            vocab_size=config["vocab_size"],
            target_layer_ids=list(fields["target_layer_ids"]),
            mask_token_id=int(fields["mask_token_id"]),
            proposal_length=int(fields["block_size"]),
            global_head_dim=config.get("global_head_dim"),
            num_global_key_value_heads=config.get("num_global_key_value_heads"),
            attention_k_eq_v=bool(config.get("attention_k_eq_v", False)),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            sliding_window=config.get("sliding_window"),
            layer_types=list(config.get("layer_types") or ["full_attention"] * layers),
            rope_parameters=dict(config.get("rope_parameters") or {}),
            max_position_embeddings=config.get("max_position_embeddings", 131072),
            markov_rank=int(fields.get("markov_rank", 256)),
            sample_from_anchor=bool(fields.get("sample_from_anchor", True)),
            enable_confidence_head=bool(fields.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(fields.get("confidence_head_with_markov", True)),
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        self.k_eq_v = args.attention_k_eq_v and not sliding
        self.head_dim = args.head_dim if sliding or not args.global_head_dim else args.global_head_dim
        self.heads = args.num_attention_heads
        self.kv_heads = (args.num_global_key_value_heads if self.k_eq_v and args.num_global_key_value_heads
                         else args.num_key_value_heads)
        self.window = args.sliding_window - 1 if sliding and args.sliding_window else None
        H = args.hidden_size
        self.q_proj = nn.Linear(H, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.eps = args.rms_norm_eps
        self.v_norm = True  # vLLM's scale-free value norm; off only to compare with mlx-vlm
        params = args.rope_parameters.get("sliding_attention" if sliding else "full_attention") or {}
        self.rope = initialize_rope(self.head_dim, params.get("rope_theta", 10_000.0), False, params,
                                    args.max_position_embeddings)

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        raw = self.k_proj(x).reshape(B, L, self.kv_heads, -1)
        values = raw if self.k_eq_v else self.v_proj(x).reshape(B, L, self.kv_heads, -1)
        if self.v_norm:
            values = mx.fast.rms_norm(values, None, self.eps)
        keys = self.rope(self.k_norm(raw).transpose(0, 2, 1, 3), offset=offset)
        return keys, values.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, context: tuple, offset, mask) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=offset)
        keys, values = self.keys_values(x, offset)
        keys = mx.concatenate([context[0], keys], axis=2)
        values = mx.concatenate([context[1], values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, args.layer_types[index] == "sliding_attention")
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, context, offset, mask):
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), context, offset, mask))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)

    def __call__(self, previous: mx.array) -> mx.array:
        """The logit correction [.., V] after tokens `previous`."""
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int, with_markov: bool):
        super().__init__()
        self.proj = nn.Linear(hidden + rank if with_markov else hidden, 1, bias=True)


class Model(nn.Module):
    """The Gemma 4 DSpark draft (same interface as `dflash.Model`, plus its own head)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = "dspark"
        H = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self.lm_head = nn.Linear(H, args.vocab_size, bias=False)
        self.markov_head = MarkovHead(args.vocab_size, args.markov_rank)
        if args.enable_confidence_head:
            self.confidence_head = ConfidenceHead(H, args.markov_rank, args.confidence_head_with_markov)

    @property
    def block_size(self) -> int:
        """Positions a round can draft, and one for the given token (as `dflash.Model`)."""
        return self.args.proposal_length + 1

    def block_tokens(self, anchor: int) -> list[int]:
        masks = self.args.proposal_length - int(self.args.sample_from_anchor)
        return [anchor] + [self.args.mask_token_id] * masks

    def embed(self, ids: mx.array) -> mx.array:
        return self.embed_tokens(ids) * (self.args.hidden_size ** 0.5)

    def logits(self, hidden: mx.array) -> mx.array:
        """Base logits [B, P, V] of a block's final hidden states [B, rows, H]."""
        if not self.args.sample_from_anchor:
            hidden = hidden[:, 1:]
        logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits

    def extend(self, context: Context, taps: mx.array) -> None:
        if taps.shape[1] == 0:
            return
        h = self.hidden_norm(self.fc(taps))
        offset = context.length
        for layer, cache in zip(self.layers, context.caches):
            cache.update_and_fetch(*layer.self_attn.keys_values(h, offset))

    def hidden(self, x: mx.array, contexts: list, offset, masks: Optional[list] = None) -> mx.array:
        h = x
        for i, (layer, context) in enumerate(zip(self.layers, contexts)):
            h = layer(h, context, offset, None if masks is None else masks[i])
        return self.norm(h)

    def step_timer(self, target, context: int) -> Callable[[], None]:
        """A round's drafting, as `dflash.Model.step_timer` times it."""
        state = Context(len(self.layers))
        taps = mx.zeros((1, context, len(self.args.target_layer_ids) * self.args.hidden_size))  # fc.weight is packed when quantized
        self.extend(state, taps)
        mx.eval([c.state for c in state.caches])
        block = mx.array([self.block_tokens(self.args.mask_token_id)])

        def run():
            self.extend(state, taps[:, :2])
            contexts = [state.layer(i, layer.self_attn.window) for i, layer in enumerate(self.layers)]
            logits = self.logits(self.hidden(self.embed(block), contexts, context + 2))
            mx.eval(logits + self.markov_head(mx.zeros(logits.shape[:2], mx.int32)))
            state.trim(2)

        return run

    def sanitize(self, weights: dict) -> dict:
        return {k.removeprefix("model."): v for k, v in weights.items()}


def target_mismatch(args: ModelArgs, target) -> Optional[str]:
    """Why a DSpark draft cannot draft for `target` (None: it can)."""
    inner = text_model(target).model
    hidden = inner.embed_tokens(mx.array([0])).shape[-1]
    vocab = inner.embed_tokens.weight.shape[0]
    depth = len(inner.layers)
    if args.hidden_size != hidden:
        return f"the DSpark draft was built for a target of hidden size {args.hidden_size}; this target's is {hidden}"
    if args.vocab_size != vocab:
        return f"the DSpark draft was built for a vocabulary of {args.vocab_size}; this target's has {vocab}"
    beyond = [i for i in args.target_layer_ids if not 0 <= i < depth]
    if beyond:
        return (f"the DSpark draft taps target layers {args.target_layer_ids}; this target has "
                f"{depth} layers (no layer {beyond[0]})")
    return None
