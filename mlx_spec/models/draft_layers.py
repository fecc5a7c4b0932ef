"""Pieces the drafts reading the target's layers share (DFlash, DFlash 2, DSpark, EAGLE-3):
the gated MLP their layers use, and a reduced-vocabulary checkpoint's weights under our names."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)): SwiGLU with SiLU (Qwen 3, Llama), GeGLU with GELU (Gemma 4)."""

    def __init__(self, dim: int, hidden: int, act: Callable[[mx.array], mx.array] = nn.silu):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def drafting_weights(weights: dict) -> dict:
    """A reduced-vocabulary draft's weights under our names (EAGLE-3's, DSpark's): `model.`
    prefixes dropped, what drafting never reads left out (`t2d`, rotary buffers, a
    `mask_embedding` placeholder), `d2t` as int32 offsets."""
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("model.")
        if key in ("t2d", "mask_embedding") or "rotary_emb" in key:
            continue
        out[key] = value.astype(mx.int32) if key == "d2t" else value
    return out
