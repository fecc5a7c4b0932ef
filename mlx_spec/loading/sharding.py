"""Tensor parallelism for the Gemma families mlx-lm has no `shard()` for.

mlx-lm's `sharded_load` shards any model class with a `shard(group)` method; its
`gemma3_text`, `gemma3`, `gemma4_text` and `gemma4` classes have none ("The model does not
support any sharding"). The functions here follow `mlx_lm.models.llama.Model.shard` line
for line (Megatron-style: q/k/v and gate/up all-to-sharded, o_proj and down sharded-to-all,
heads and kv heads ÷ N, two all-reduces per layer per forward), so each could become that
class's `shard` method upstream unchanged; `install()` attaches them to mlx-lm's classes
without forking mlx-lm.

What divides (N = group size):
  q heads           N must divide them (each rank owns H/N query heads).
  kv heads          N divides them: split like q. Fewer kv heads than ranks (Gemma 3 270M has
                    4 q heads and 1 kv head): each kv head is *replicated* on the N/kv ranks
                    whose query heads read it, as vLLM does, so N must be a multiple of the kv
                    head count. The cost is recomputing k/v on each replica (1/H of attention
                    work per replica); the alternative, refusing, would forbid TP on every
                    Gemma with a single kv head.
  MLP width         N must divide the intermediate size.
  quantized layers  the sharded-to-all layers (o_proj, down_proj) are cut along their input,
                    so each rank's part must hold whole quantization groups:
                    group_size · N must divide heads·head_dim and the intermediate size.
Anything else is refused by `check_shardable` with a one-line `MlxSpecError` naming the
first number that does not divide and the N that would work.

Embeddings, norms, the LM head and Gemma 4's per-layer-input projections and MoE router
stay replicated: they are small next to the layers (except the 262k-row embedding, which
each rank holds whole, as llama's shard does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

from mlx_spec.cache.forward import text_model
from mlx_spec.errors import MlxSpecError

SHARDABLE = ("gemma3_text", "gemma3", "gemma4_text", "gemma4")


@dataclass(frozen=True)
class _Slot:
    """A stand-in group for `shard_inplace`: keep part `rank` of `size` equal parts,
    without any communication (used to pick the one kv head a rank replicates)."""

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


def _divisors_ok(n_heads: int, n_kv: int, widths: list[int], group_size: Optional[int]) -> list[int]:
    """Every N in 1..n_heads for which the layer shards (for the error's hint)."""
    ok = []
    for n in range(1, n_heads + 1):
        if n_heads % n or (n_kv % n and n % n_kv):
            continue
        if any(w % n or (group_size and (w // n) % group_size) for w in widths):
            continue
        ok.append(n)
    return ok


def _group_size(*layers) -> Optional[int]:
    sizes = {getattr(layer, "group_size", None) for layer in layers} - {None}
    return max(sizes) if sizes else None


def _check_layer(i: int, attn, mlp, N: int, head_dim: int) -> None:
    n_heads, n_kv = attn.n_heads, attn.n_kv_heads
    o_width = n_heads * head_dim
    mlp_width = mlp.gate_proj.weight.shape[0]
    group_size = _group_size(attn.o_proj, mlp.down_proj)
    problem = None
    if n_heads % N:
        problem = f"{n_heads} query heads"
    elif n_kv % N and N % n_kv:
        problem = f"{n_kv} kv heads (need N dividing them, or a multiple of them)"
    elif mlp_width % N:
        problem = f"an MLP width of {mlp_width}"
    elif group_size and ((o_width // N) % group_size or (mlp_width // N) % group_size):
        problem = (f"quantization groups of {group_size} (each rank's share of widths "
                   f"{o_width} and {mlp_width} must be whole groups)")
    if problem:
        ok = _divisors_ok(n_heads, n_kv, [o_width, mlp_width], group_size)
        raise MlxSpecError(
            f"cannot shard over {N} ranks: layer {i} has {problem}; "
            f"ranks that divide this model: {', '.join(map(str, ok))}")


def _attention_layers(model):
    """(text model, its layers) for any of the supported wrappers."""
    text = text_model(model)
    return text, text.model.layers


def check_shardable(model, N: int) -> None:
    """Raise `MlxSpecError` (one line) unless `model` shards over N ranks."""
    model_type = getattr(getattr(model, "args", None), "model_type", None) or getattr(model, "model_type", "?")
    if model_type not in SHARDABLE:
        raise MlxSpecError(f"tensor parallelism supports {', '.join(SHARDABLE)}, not {model_type}")
    if N < 1:
        raise MlxSpecError(f"a group needs at least one rank, not {N}")
    text, layers = _attention_layers(model)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        _check_layer(i, attn, layer.mlp, N, attn.head_dim)
        experts = getattr(layer, "experts", None) if getattr(layer, "enable_moe", False) else None
        if experts is not None:
            width = experts.switch_glu.gate_proj.weight.shape[1]
            gs = _group_size(experts.switch_glu.down_proj)
            if width % N or (gs and (width // N) % gs):
                raise MlxSpecError(f"cannot shard over {N} ranks: layer {i}'s experts are "
                                   f"{width} wide" + (f" in groups of {gs}" if gs else ""))


# ---------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------


def _shard_kv(proj, n_kv: int, group) -> nn.Module:
    """k_proj / v_proj: split by kv head when N divides them; otherwise keep (replicate)
    the one kv head this rank's query heads read: head rank·kv/N."""
    N, r = group.size(), group.rank()
    if n_kv % N == 0:
        return shard_linear(proj, "all-to-sharded", group=group)
    shard_inplace(proj, "all-to-sharded", group=_Slot(r * n_kv // N, n_kv))
    return proj


def _shard_attention(attn, group) -> None:
    N = group.size()
    n_kv = attn.n_kv_heads
    attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
    # Gemma 4's KV-shared layers have no k/v projections: they read the kv of an earlier
    # layer of the same type, which is sharded (or replicated) the same way.
    if "k_proj" in attn:
        attn.k_proj = _shard_kv(attn.k_proj, n_kv, group)
    if "v_proj" in attn:
        attn.v_proj = _shard_kv(attn.v_proj, n_kv, group)
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= N
    attn.n_kv_heads = max(n_kv // N, 1)
    if hasattr(attn, "repeats"):
        attn.repeats = attn.n_heads // attn.n_kv_heads


def _shard_mlp(mlp, group) -> None:
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)


def shard_gemma3_text(self, group: Optional[mx.distributed.Group] = None) -> None:
    """`gemma3_text.Model.shard`: tensor parallelism over `group` (default: the world)."""
    group = group or mx.distributed.init()
    check_shardable(self, group.size())
    for layer in self.model.layers:
        _shard_attention(layer.self_attn, group)
        _shard_mlp(layer.mlp, group)


def _sharded_experts_class():
    from mlx_lm.models import gemma4_text

    class ShardedExperts(gemma4_text.Experts):
        """Experts whose SwitchGLU holds 1/N of every expert's hidden units; the partial
        outputs are summed over the group (mlx-lm's MoE blocks keep a `sharding_group`
        for the same all-reduce)."""

        def __call__(self, x, top_k_indices, top_k_weights):
            y = super().__call__(x, top_k_indices, top_k_weights)
            return mx.distributed.all_sum(y, group=self.sharding_group)

    return ShardedExperts


def shard_gemma4_text(self, group: Optional[mx.distributed.Group] = None) -> None:
    """`gemma4_text.Model.shard`: as Gemma 3, plus the MoE experts (26B A4B), sharded in
    place with the router replicated. KV-shared layers shard only q and o."""
    group = group or mx.distributed.init()
    check_shardable(self, group.size())
    experts_class = None
    for layer in self.model.layers:
        _shard_attention(layer.self_attn, group)
        _shard_mlp(layer.mlp, group)
        if getattr(layer, "enable_moe", False):
            experts_class = experts_class or _sharded_experts_class()
            glu = layer.experts.switch_glu
            shard_inplace(glu.gate_proj, "all-to-sharded", group=group)
            shard_inplace(glu.up_proj, "all-to-sharded", group=group)
            shard_inplace(glu.down_proj, "sharded-to-all", group=group)
            layer.experts.__class__ = experts_class
            layer.experts.sharding_group = group


def shard_wrapper(self, group: Optional[mx.distributed.Group] = None) -> None:
    """`gemma3.Model.shard` / `gemma4.Model.shard`: the multimodal wrappers shard their
    language model (the vision tower is dropped on load)."""
    self.language_model.shard(group)


def install() -> None:
    """Give mlx-lm's Gemma classes a `shard` method (idempotent), so `model.shard(group)`
    and mlx-lm's own `sharded_load` work on them."""
    from mlx_lm.models import gemma3, gemma3_text, gemma4, gemma4_text

    for cls, method in ((gemma3_text.Model, shard_gemma3_text), (gemma4_text.Model, shard_gemma4_text),
                        (gemma3.Model, shard_wrapper), (gemma4.Model, shard_wrapper)):
        if not hasattr(cls, "shard"):
            cls.shard = method


def shard_model(model, group: Optional[mx.distributed.Group] = None) -> None:
    """Shard `model` in place over `group` (tensor parallel); a group of one is a no-op."""
    group = group or mx.distributed.init()
    check_shardable(model, group.size())
    if group.size() == 1:
        return
    install()
    model.shard(group)
