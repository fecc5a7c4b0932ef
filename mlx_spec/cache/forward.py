"""The model's forward passes as our caches need them: logits, final hidden states or both,
and, while a draft tree or an image is fed, the masks and RoPE positions it needs.

A draft tree (`mlx_spec.core.tree`) is verified in one pass: while `SequenceCache.forward` feeds
one (`feeding_tree`), every layer's mask shows each row the prefix and its ancestors only,
and RoPE puts each row at prefix + depth.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.cache.global_layers import ChannelQuantizedKVCache, TreeKVCache
from mlx_spec.cache.window_layers import WindowKVCache
from mlx_spec.core.tree import TreeShape


def text_model(model):
    """The text model: a multimodal wrapper's `language_model`, else `model` itself."""
    return getattr(model, "language_model", model)


class _PositionedRoPE(nn.Module):
    """An attention layer's own RoPE, applied at one given position per row (mlx-lm's
    attention passes the cache offset, a position for the first row only). Rows become
    the batch axis, where MLX's rope takes a vector of offsets."""

    def __init__(self, rope, positions: mx.array):
        super().__init__()
        self.inner, self.positions = rope, positions

    def __call__(self, x: mx.array, offset=None) -> mx.array:
        B, H, L, D = x.shape
        rows = x.transpose(2, 0, 1, 3).reshape(L, B * H, 1, D)
        return self.inner(rows, offset=self.positions).reshape(L, B, H, D).transpose(1, 2, 0, 3)


def attention_layers(model) -> list:
    return [getattr(layer, "self_attn", None) for layer in text_model(model).layers]


def tree_capable(model, cache: list) -> bool:
    """Whether a draft tree can be fed: every cache layer is ours (tree masks, compaction)
    and every attention layer has a `rope` to position by depth."""
    layers = attention_layers(model)
    return (all(isinstance(c, (TreeKVCache, ChannelQuantizedKVCache, WindowKVCache)) for c in cache)
            and all(a is not None and isinstance(getattr(a, "rope", None), nn.Module) for a in layers))


@contextmanager
def ropes_replaced(model, positioned: Callable):
    """While the model's graph is built, each attention layer's RoPE is `positioned(rope)`.
    (MLX is lazy: the graph keeps them once the call returns.)"""
    layers = attention_layers(model)
    ropes = [a.rope for a in layers]
    try:
        for attention, rope in zip(layers, ropes):
            attention.rope = positioned(rope)
        yield
    finally:
        for attention, rope in zip(layers, ropes):
            attention.rope = rope


@contextmanager
def feeding_tree(model, cache: list, shape: TreeShape, root: int):
    """While the model's graph is built: tree masks in every cache layer, and each row's
    RoPE at root + depth."""
    positions = mx.array([root, *(root + d for d in shape.depth)], mx.int32)
    try:
        for layer in cache:
            layer.tree = shape
        with ropes_replaced(model, lambda rope: _PositionedRoPE(rope, positions)):
            yield
    finally:
        for layer in cache:
            layer.tree = None


@contextmanager
def images_opened(cache: list, blocks: Optional[mx.array]):
    """While the model's graph is built: the sliding-window layers' masks open each image's
    rows to each other (`WindowKVCache.image_blocks`); nothing when `blocks` is None."""
    windows = [layer for layer in cache if isinstance(layer, WindowKVCache)] if blocks is not None else []
    try:
        for layer in windows:
            layer.image_blocks = blocks
        yield
    finally:
        for layer in windows:
            layer.image_blocks = None

def final_hidden(model, inputs: mx.array, cache, **embedded) -> mx.array:
    """The decoder's final (post-norm) hidden states, without the LM head: mlx-lm's
    Gemma-family models are a decoder `model.model` ending in its final norm. `embedded`:
    `input_embeddings` for the rows (an image prompt's, `mlx_spec.models.vision`)."""
    return text_model(model).model(inputs, cache=cache, **embedded)


def logits_and_hidden(model, inputs: mx.array, cache, **embedded) -> tuple[mx.array, mx.array]:
    """One forward that also returns the final (post-norm) hidden states, for drafters that
    read them: the decoder (`final_hidden`), then a tied embedding or an `lm_head`, then an
    optional logit soft-cap."""
    lm = text_model(model)
    hidden = final_hidden(model, inputs, cache, **embedded)
    if getattr(lm, "tie_word_embeddings", not hasattr(lm, "lm_head")):
        logits = lm.model.embed_tokens.as_linear(hidden)
    else:
        logits = lm.lm_head(hidden)
    cap = getattr(lm, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits, hidden


def forward_model(model, tokens: mx.array, cache, hidden: bool = False, head: bool = True, **embedded):
    """The model over tokens [B, L]: logits; with hidden=True (logits, final hidden states);
    with head=False the final hidden states only. `embedded`: `input_embeddings` for the
    rows (an image prompt's)."""
    if not head:
        return final_hidden(model, tokens, cache, **embedded)
    if hidden:
        return logits_and_hidden(model, tokens, cache, **embedded)
    return model(tokens, cache=cache, **embedded)

