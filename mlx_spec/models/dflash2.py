"""DFlash 2 (`DFlash2DraftModel`): DFlash's block draft (`mlx_spec.models.dflash`: context
keys and values from fc(taps), the block [last, mask, …] in one non-causal forward, the
target's embedding and head) with two additions:

- two-tap dynamic grouped convolutions around each layer's attention and MLP, causal along
  the block (row t reads rows t, t − 1, …, t − kernel + 1 of the block, none of the
  context): `prepare` convolves the normed input with kernel 0 (a base kernel plus one
  predicted from each row), `finish` convolves the sublayer's output with kernel 1; the
  context's keys and values are projected from the context without them, as in DFlash;
- a candidate selector: position j keeps the `selector_top_k` highest of its logits and
  rescores each candidate c after the token p drawn before it (the anchor for j = 0) with a
  bilinear lattice, score(c) = logit(c) + Σ_r P[p]_r · W h_j,r · S[c]_r (the predecessor and
  successor codebooks P, S and the hidden projection W, rank `selector_rank`).

Embeddings are scaled by `input_embedding_scale` on top of the target's, logits multiplied
by `output_multiplier` before the soft-cap. The codebooks are stored without a `.weight`
suffix. Packaging: `architectures: ["DFlash2DraftModel"]` with DFlash's config and the
DFlash 2 fields under `dflash_config` (`conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k`, `input_embedding_scale`, `output_multiplier`, a logit
soft-cap), as mlx-vlm 0.7.10's `DFlash2Config` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.models import dflash
from mlx_spec.models.dflash import TargetHead, block_timer

EXTRA = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
         "input_embedding_scale", "output_multiplier")


def is_dflash2_config(config: dict) -> bool:
    """A DFlash 2 draft's config.json."""
    return "DFlash2DraftModel" in (config.get("architectures") or ())


@dataclass
class ModelArgs(dflash.ModelArgs):
    conv_kernel_size: int = 2
    conv_group_size: int = 1
    selector_rank: int = 16
    selector_top_k: int = 8
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    model_type: str = "dflash2"

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        base = dflash.ModelArgs.from_dict(config)
        nested = config["dflash_config"]
        extra = {k: nested.get(k, config.get(k)) for k in EXTRA if nested.get(k, config.get(k)) is not None}
        cap = nested.get("final_logit_softcapping", base.final_logit_softcapping)
        values = {f.name: getattr(base, f.name) for f in fields(dflash.ModelArgs) if f.name != "model_type"}
        return cls(**{**values, "final_logit_softcapping": cap, **extra})


def grouped_causal_convolve(x: mx.array, dynamic: mx.array, base: mx.array, group: int) -> mx.array:
    """Σ_k (base[k] + dynamic[:, :, k]) · x shifted k rows down the block (zeros above).
    x [B, L, H]; dynamic [B, L, K, H / group]; base [K, H]; the dynamic weight is one per
    group of `group` channels."""
    B, L, H = x.shape
    groups = H // group
    blocks = x.reshape(B, L, groups, group)
    out = mx.zeros_like(blocks)
    for k in range(base.shape[0]):
        shifted = blocks if k == 0 else mx.concatenate([mx.zeros_like(blocks[:, :k]), blocks[:, :-k]], axis=1)
        kernel = base[k].reshape(1, 1, groups, group).astype(x.dtype) + dynamic[:, :, k, :, None]
        out = out + kernel * shifted
    return out.reshape(B, L, H)


class GroupedConv(nn.Module):
    """The pair of dynamic grouped convolutions around one sublayer."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x convolved with kernel 0, and kernel 1's dynamic part for `finish`."""
        dynamic = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel, -1)
        return grouped_causal_convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group), dynamic[..., 1, :, :]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_causal_convolve(y, dynamic, self.base_kernel[1], self.group)


class DecoderLayer(dflash.DecoderLayer):
    def __init__(self, args: ModelArgs, index: int, rope):
        super().__init__(args, index, rope)
        self.attention_conv = GroupedConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, x, context, offset, mask):
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(h, context, offset, mask), kernel)
        y, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(y), kernel)


class CandidateSelector(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.selector_top_k
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)

    def candidates(self, logits: mx.array) -> mx.array:
        """[.., top_k] each position's candidate ids (in no particular order)."""
        return mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k:]

    def scores(self, logits: mx.array, projected: mx.array, candidates: mx.array, previous: mx.array) -> mx.array:
        """One position's candidate scores [1, top_k]: logits [1, V], projected hidden [1, r],
        candidates [1, top_k], the token drawn before [1]."""
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        lattice = self.predecessor_codebook(previous) * projected  # [1, r]
        return unary + mx.sum(lattice[:, None] * self.successor_codebook(candidates), axis=-1)


class Model(dflash.Model):
    """The DFlash 2 draft; the drafter lends it the target's embedding and head."""

    layer_class = DecoderLayer

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model_type = "dflash2"
        self.candidate_selector = CandidateSelector(args)

    def embed(self, head: TargetHead, ids: mx.array) -> mx.array:
        return head.embed(ids) * self.args.input_embedding_scale

    def logits(self, head: TargetHead, hidden: mx.array) -> mx.array:
        """Base logits [B, L, V] of final hidden states [B, L, H]."""
        logits = head.head(hidden) * self.args.output_multiplier
        cap = head.softcap
        return mx.tanh(logits / cap) * cap if cap else logits

    def step_timer(self, target, context: int) -> Callable[[], None]:
        """A round's drafting (`dflash.Model.step_timer`), the selector's scores included."""
        head = TargetHead(target, self.args.final_logit_softcapping)
        block = mx.array([[self.args.mask_token_id] * self.block_size])
        selector = self.candidate_selector

        def draft(contexts, offset):
            hidden = self.hidden(self.embed(head, block), contexts, offset)[:, 1:]
            logits = self.logits(head, hidden)[0]
            candidates, projected = selector.candidates(logits), selector.hidden_projection(hidden[0])
            previous = mx.array([0])
            for j in range(logits.shape[0]):
                scores = selector.scores(logits[j : j + 1], projected[j : j + 1], candidates[j : j + 1], previous)
                previous = mx.take_along_axis(candidates[j : j + 1], mx.argmax(scores, axis=-1)[:, None], axis=-1)[:, 0]
            return previous

        return block_timer(self, context, draft)

    def sanitize(self, weights: dict) -> dict:
        codebooks = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
        out = {}
        for key, value in weights.items():
            key = key.removeprefix("model.")
            out[f"{key}.weight" if key in codebooks else key] = value
        return out


def target_mismatch(args: ModelArgs, target) -> Optional[str]:
    """Why a DFlash 2 draft cannot draft for `target` (None: it can): DFlash's checks."""
    mismatch = dflash.target_mismatch(args, target)
    return mismatch.replace("DFlash draft", "DFlash 2 draft") if mismatch else None
