"""DSpark (DeepSeek DeepSpec): a block draft over the target's tap layers, as DFlash
(`mlx_spec.models.dflash`: context keys and values from fc(taps), a block [anchor, mask, …]
drafted in one non-causal forward), plus a Markov head and a confidence head. Two backbones:

- Gemma 4 (`Gemma4DSparkModel`, the Gemma 4 drafts): four sandwich norms, `layer_scalar`,
  GeGLU MLP, unit attention scale; full-attention layers at `global_head_dim`, and with
  `attention_k_eq_v` no `v_proj`: the values are the key projection
  (`num_global_key_value_heads` heads), before k_norm; a scale-free RMS norm on values
  (`v_norm`), as Gemma 4's own attention and vLLM's `Gemma4DSparkModel` apply it (mlx-vlm
  0.7.10's DSpark applies none); its own embedding (scaled by √H) and LM head;
- Qwen 3 (SpecForge's and speculators' `DSparkDraftModel`): DFlash's layers, with the
  target's embedding and head unless the checkpoint ships its own (as mlx-vlm's
  `DSparkDraftModel` binds them).

Both: the logit soft-cap; a low-rank Markov head, position j's logits +
markov_w2(markov_w1(previous token)), the previous token (a target id) being the anchor for
the first position and the token drawn at j − 1 after it, so each draft token's distribution
is conditioned on the one before it; a reduced draft vocabulary (`draft_vocab_size`, `d2t`:
draft id d is target id d + d2t[d]) for lm_head and markov_w2, mapped into the target's
vocabulary when drawn (vLLM's `map_draft_to_target`); `sample_from_anchor` (default true
where a packaging does not say): the anchor's own row scores the first draft token (block
[anchor, mask × (P − 1)]); false: block [anchor, mask × P], the anchor row dropped. Getting
this wrong halves acceptance with no error, hence the setting is read, not assumed.

The confidence head (`confidence_head.proj`, with `enable_confidence_head`) estimates each
draft position's chance of acceptance, sigmoid(proj([h_j ; markov_w1(previous token)]));
the drafter may cut a block at the first position below a threshold (DeepSpec's prefix
policy), a stopping rule on kept tokens, so exact either way.

Packagings read (`packaging`):
- DeepSpec-native: `architectures: ["Gemma4DSparkModel"]`, `model_type: gemma4_text`, the
  DSpark fields flat or under `dflash_config` (`block_size`: the proposal length, anchor not
  counted), per-layer-type `rope_parameters`;
- vLLM speculators: `speculators_config.algorithm: "dspark"` (or `speculators_model_type`),
  the backbone in `transformer_layer_config`, `aux_hidden_state_layer_ids` (id i is target
  layer i − 1's output, as vLLM's `update_dspark` maps it), `draft_vocab_size` with `d2t`,
  `block_size` the query block's rows (anchor included), and the anchor a bonus token
  (`sample_from_anchor` false, vLLM's `dspark_bonus_anchor`) unless the config says;
- SpecForge: `dflash_config.projector_type: "dspark"` (or a `markov_rank`) beside a Qwen 3
  (or Gemma 4) config, `block_size` the proposal length, as mlx-vlm's `DSparkConfig` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from mlx_spec.core.cache.forward import text_model
from mlx_spec.models import dflash
from mlx_spec.models.dflash import BlockBackbone, ContextAttention, TargetHead, block_timer
from mlx_spec.models.draft_layers import GatedMLP, drafting_weights

DSPARK_FIELDS = ("mask_token_id", "target_layer_ids", "markov_rank", "enable_confidence_head",
                 "confidence_head_with_markov", "confidence_threshold", "sample_from_anchor", "block_size")


def packaging(config: dict) -> Optional[str]:
    """Which DSpark packaging a config.json is in: "deepspec", "speculators", "specforge"
    (None: not a DSpark draft)."""
    if "Gemma4DSparkModel" in (config.get("architectures") or ()):
        return "deepspec"
    speculators = config.get("speculators_config") or {}
    if config.get("speculators_model_type") == "dspark" or speculators.get("algorithm") == "dspark":
        return "speculators"
    nested = config.get("dflash_config")
    if isinstance(nested, dict) and "DFlash2DraftModel" not in (config.get("architectures") or ()):
        if nested.get("projector_type") == "dspark" or int(config.get("markov_rank") or nested.get("markov_rank") or 0):
            return "specforge"
    return None


def is_dspark_config(config: dict) -> bool:
    """A DSpark draft's config.json, in any of the three packagings."""
    return packaging(config) is not None


def _normalized(config: dict) -> tuple[str, dict]:
    """(packaging, one flat dict of the backbone's and the DSpark fields): `target_layer_ids`
    as target layer indices, `proposal_length` the tokens a block drafts, `sample_from_anchor`
    resolved."""
    kind = packaging(config)
    if kind == "speculators":
        fields = dict(config["transformer_layer_config"])
        fields.update({k: config[k] for k in DSPARK_FIELDS + ("draft_vocab_size", "target_hidden_size")
                       if config.get(k) is not None})
        fields["target_layer_ids"] = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
        fields.setdefault("sample_from_anchor", False)  # vLLM's update_dspark: the anchor is a bonus token
        rows = int(fields.get("block_size", 8))
        fields["proposal_length"] = rows - 1 + int(fields["sample_from_anchor"])
        fields.setdefault("enable_confidence_head", False)
        fields.setdefault("confidence_head_with_markov", False)
        return kind, fields
    nested = config.get("dflash_config")
    fields = dict(config, **nested) if isinstance(nested, dict) else dict(config)
    fields.pop("dflash_config", None)
    raw = int(nested.get("block_size") if isinstance(nested, dict) and nested.get("block_size") else
              config["block_size"])
    bonus = bool(config.get("dspark_bonus_anchor", False))  # mlx-vlm: block_size counts the anchor then
    fields["proposal_length"] = raw - int(bonus)
    if bonus:
        fields.setdefault("sample_from_anchor", False)
    return kind, fields


@dataclass
class ModelArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    target_layer_ids: list
    mask_token_id: int
    proposal_length: int
    backbone: str = "gemma4"  # "gemma4" or "qwen3"
    packaging: str = "deepspec"
    draft_vocab_size: Optional[int] = None  # None: the target's whole vocabulary
    target_hidden_size: Optional[int] = None
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
    confidence_threshold: Optional[float] = None
    backbone_config: dict = field(default_factory=dict)  # the Qwen 3 backbone's, for dflash.ModelArgs
    model_type: str = "dspark"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        kind, fields = _normalized(config)
        layers = fields["num_hidden_layers"]
        gemma = kind == "deepspec" or str(fields.get("model_type", "")).startswith("gemma4")
        draft_vocab = fields.get("draft_vocab_size")
        threshold = fields.get("confidence_threshold")
        return cls(
            hidden_size=fields["hidden_size"],
            intermediate_size=fields["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=fields["num_attention_heads"],
            num_key_value_heads=fields.get("num_key_value_heads", fields["num_attention_heads"]),
            head_dim=fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"],
            vocab_size=fields["vocab_size"],
            target_layer_ids=list(fields["target_layer_ids"]),
            mask_token_id=int(fields["mask_token_id"]),
            proposal_length=int(fields["proposal_length"]),
            backbone="gemma4" if gemma else "qwen3",
            packaging=kind,
            draft_vocab_size=int(draft_vocab) if draft_vocab and draft_vocab < fields["vocab_size"] else None,
            target_hidden_size=fields.get("target_hidden_size"),
            global_head_dim=fields.get("global_head_dim"),
            num_global_key_value_heads=fields.get("num_global_key_value_heads"),
            attention_k_eq_v=bool(fields.get("attention_k_eq_v", False)),
            rms_norm_eps=fields.get("rms_norm_eps", 1e-6),
            final_logit_softcapping=fields.get("final_logit_softcapping"),
            sliding_window=fields.get("sliding_window"),
            layer_types=list(fields.get("layer_types") or ["full_attention"] * layers),
            rope_parameters=dict(fields.get("rope_parameters") or {}),
            max_position_embeddings=fields.get("max_position_embeddings", 131072),
            markov_rank=int(fields.get("markov_rank", 256)),
            sample_from_anchor=bool(fields.get("sample_from_anchor", True)),
            enable_confidence_head=bool(fields.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(fields.get("confidence_head_with_markov", True)),
            confidence_threshold=None if threshold is None else float(threshold),
            backbone_config={} if gemma else fields,
        )

    @property
    def draft_vocab(self) -> int:
        """Rows of the draft's LM head (and Markov output)."""
        return self.draft_vocab_size or self.vocab_size

    def dflash_args(self) -> dflash.ModelArgs:
        """The Qwen 3 backbone's arguments, as DFlash reads them."""
        nested = {"block_size": self.proposal_length + 1, "target_layer_ids": self.target_layer_ids,
                  "mask_token_id": self.mask_token_id}
        return dflash.ModelArgs.from_dict({**self.backbone_config, "dflash_config": nested})


class Attention(ContextAttention):
    """Gemma 4's: unit scale, global head size and K = V on full layers, values normed."""

    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        self.scale = 1.0
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


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, args.layer_types[index] == "sliding_attention")
        self.mlp = GatedMLP(H, args.intermediate_size, nn.gelu_approx)
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
    def __init__(self, vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # indexed by target ids
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)

    def __call__(self, previous: mx.array) -> mx.array:
        """The logit correction [.., draft vocabulary] after (target) tokens `previous`."""
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden + rank if with_markov else hidden, 1, bias=True)


class DSparkHeads:
    """What both backbones share: the block, the Markov and confidence heads, the reduced
    vocabulary. Needs `args`, `markov_head`, optionally `confidence_head` and `d2t`."""

    @property
    def block_size(self) -> int:
        """Positions a round can draft, and one for the given token (as `dflash.Model`)."""
        return self.args.proposal_length + 1

    def block_tokens(self, anchor: int) -> list[int]:
        masks = self.args.proposal_length - int(self.args.sample_from_anchor)
        return [anchor] + [self.args.mask_token_id] * masks

    def head_hidden(self, hidden: mx.array) -> mx.array:
        """The rows [B, P, H] of a block's final hidden states [B, rows, H] that score the
        draft positions."""
        return hidden if self.args.sample_from_anchor else hidden[:, 1:]

    def softcapped(self, logits: mx.array, cap: Optional[float]) -> mx.array:
        return mx.tanh(logits / cap) * cap if cap else logits

    def target_ids(self) -> mx.array:
        """[draft vocabulary] the target id of each draft id."""
        ids = mx.arange(self.args.draft_vocab, dtype=mx.int32)
        return ids + self.d2t if "d2t" in self else ids

    def confidence(self, hidden: mx.array, previous: mx.array) -> mx.array:
        """Each position's estimated chance of acceptance [P] (float32) from its head row
        [P, H] and the (target) token before it [P]."""
        features = hidden
        if self.confidence_head.with_markov:
            features = mx.concatenate([hidden, self.markov_head.markov_w1(previous)], axis=-1)
        return mx.sigmoid(self.confidence_head.proj(features).squeeze(-1).astype(mx.float32))

    def add_heads(self, hidden: int) -> None:
        args = self.args
        self.markov_head = MarkovHead(args.vocab_size, args.draft_vocab, args.markov_rank)
        if args.enable_confidence_head:
            self.confidence_head = ConfidenceHead(hidden, args.markov_rank, args.confidence_head_with_markov)
        if args.draft_vocab_size is not None:
            self.d2t = mx.zeros((args.draft_vocab_size,), mx.int32)

    def sanitize(self, weights: dict) -> dict:
        return drafting_weights(weights)


class Gemma4Model(DSparkHeads, BlockBackbone):
    """The Gemma 4 DSpark draft (same interface as `dflash.Model`, plus its own embedding
    and head)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = "dspark"
        H = args.hidden_size
        self.fc = nn.Linear(len(args.target_layer_ids) * (args.target_hidden_size or H), H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self.lm_head = nn.Linear(H, args.draft_vocab, bias=False)
        self.add_heads(H)

    def bind(self, target) -> None:
        """Nothing to borrow: the embedding and head are its own."""

    def embed(self, ids: mx.array) -> mx.array:
        return self.embed_tokens(ids) * (self.args.hidden_size ** 0.5)

    def logits(self, hidden: mx.array) -> mx.array:
        """Base logits [B, P, draft vocabulary] of a block's final hidden states [B, rows, H]."""
        return self.softcapped(self.lm_head(self.head_hidden(hidden)), self.args.final_logit_softcapping)

    def step_timer(self, target, context: int) -> Callable[[], None]:
        return _step_timer(self, context)


class Qwen3Model(DSparkHeads, dflash.Model):
    """The Qwen 3 DSpark draft: DFlash's backbone and the DSpark heads; the target's
    embedding and head (`bind`) unless the checkpoint ships its own (`sanitize` adds them)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.dflash_args())
        self.backbone_args, self.args = self.args, args
        self.model_type = "dspark"
        self.add_heads(args.hidden_size)
        self.target_head: Optional[TargetHead] = None

    def bind(self, target) -> None:
        self.target_head = TargetHead(target, self.args.final_logit_softcapping)

    def embed(self, ids: mx.array) -> mx.array:
        if "embed_tokens" in self:
            return self.embed_tokens(ids)  # its own, unscaled (vLLM's Qwen 3 DSpark)
        return self.target_head.embed(ids)

    def logits(self, hidden: mx.array) -> mx.array:
        hidden = self.head_hidden(hidden)
        if "lm_head" in self:
            return self.softcapped(self.lm_head(hidden), self.target_head.softcap)
        return self.target_head.logits(hidden)

    def step_timer(self, target, context: int) -> Callable[[], None]:
        self.bind(target)
        return _step_timer(self, context)

    def sanitize(self, weights: dict) -> dict:
        weights = DSparkHeads.sanitize(self, weights)
        H = self.args.hidden_size
        if "embed_tokens.weight" in weights:
            self.embed_tokens = nn.Embedding(self.args.vocab_size, H)
        if "lm_head.weight" in weights:
            self.lm_head = nn.Linear(H, self.args.draft_vocab, bias=False)
        return weights


def Model(args: ModelArgs):  # noqa: N802 (mlx-lm's loader calls `Model(args)`)
    """The DSpark draft for `args`, on its backbone."""
    return Qwen3Model(args) if args.backbone == "qwen3" else Gemma4Model(args)


def _step_timer(model, context: int) -> Callable[[], None]:
    """A round's drafting (`dflash.block_timer`): the block forward, its logits, the Markov
    correction."""
    block = mx.array([model.block_tokens(model.args.mask_token_id)])

    def draft(contexts, offset):
        logits = model.logits(model.hidden(model.embed(block), contexts, offset))
        return logits + model.markov_head(mx.zeros(logits.shape[:2], mx.int32))

    return block_timer(model, context, draft)


def target_mismatch(args: ModelArgs, target) -> Optional[str]:
    """Why a DSpark draft cannot draft for `target` (None: it can)."""
    inner = text_model(target).model
    hidden = inner.embed_tokens(mx.array([0])).shape[-1]
    vocab = inner.embed_tokens.weight.shape[0]
    depth = len(inner.layers)
    wanted = args.target_hidden_size or args.hidden_size
    if wanted != hidden:
        return f"the DSpark draft was built for a target of hidden size {wanted}; this target's is {hidden}"
    if args.vocab_size != vocab or args.mask_token_id >= vocab:
        return (f"the DSpark draft was built for a vocabulary of {args.vocab_size} (mask token "
                f"{args.mask_token_id}); this target's has {vocab}")
    beyond = [i for i in args.target_layer_ids if not 0 <= i < depth]
    if beyond:
        return (f"the DSpark draft taps target layers {args.target_layer_ids}; this target has "
                f"{depth} layers (no layer {beyond[0]})")
    return None
