"""Drafters: who proposes the γ tokens the target verifies.

`mlx_spec.core.drafter` declares the protocol the engine calls (`Drafter`, `Draft`); each
family here is one module, and `DRAFTERS` below, the registry the CLI, presets, server and
runner read, maps the name a user types (`--drafter NAME`) to its class. "none" (plain decoding) is no drafter.
"""

from __future__ import annotations

from mlx_spec.core.drafter import Draft, Drafter
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.drafters.dflash2 import DFlash2Drafter
from mlx_spec.drafters.dspark import DSparkDrafter
from mlx_spec.drafters.eagle3 import Eagle3Drafter
from mlx_spec.drafters.model import ModelDrafter
from mlx_spec.drafters.mtp import MtpDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.drafters.suffix import SuffixDrafter
from mlx_spec.errors import UsageError

# name -> class: a new drafter family adds one line here
DRAFTERS: dict[str, type[Drafter]] = {
    ModelDrafter.name: ModelDrafter,  # a small draft model (Leviathan's Mq)
    MtpDrafter.name: MtpDrafter,  # Gemma 4's MTP assistant, over the target's states
    NgramDrafter.name: NgramDrafter,  # prompt lookup, no model
    SuffixDrafter.name: SuffixDrafter,  # suffix lookup here and in earlier requests, no model
    DFlashDrafter.name: DFlashDrafter,  # z-lab's DFlash: a block per forward from the target's taps
    DFlash2Drafter.name: DFlash2Drafter,  # DFlash 2: DFlash's block, candidates rescored by a lattice
    Eagle3Drafter.name: Eagle3Drafter,  # EAGLE-3 (speculators format) over three target layers
    DSparkDrafter.name: DSparkDrafter,  # DSpark: DFlash's block, Markov-corrected
}
NO_DRAFTER = "none"
# What `--drafter` accepts.
DRAFTER_NAMES = (*DRAFTERS, NO_DRAFTER)


def drafter_class(name: str) -> type[Drafter] | None:
    """The registered class for `name` (None for "none"); a one-line `UsageError` for a
    name that is neither."""
    if name == NO_DRAFTER:
        return None
    if name not in DRAFTERS:
        raise UsageError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTER_NAMES)}", flag="--drafter")
    return DRAFTERS[name]


__all__ = ["DRAFTERS", "DRAFTER_NAMES", "NO_DRAFTER", "Draft", "Drafter", "drafter_class", "DFlashDrafter", "DFlash2Drafter",
           "DSparkDrafter", "Eagle3Drafter", "ModelDrafter", "MtpDrafter", "NgramDrafter", "SuffixDrafter"]
