"""From loaded models to a running engine: choose the drafter and the γ policy.

The CLI and the benchmarks build engines here, so `--drafter` and `--gamma auto` mean the
same thing everywhere.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

from mlx_spec.costs import load_or_measure
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.policy import AutoGamma, FixedGamma, GammaPolicy

DRAFTERS = ("model", "ngram", "none")
MAX_AUTO_GAMMA = 6


def build_engine(pair, drafter: Optional[str] = None, *, max_gamma: int = 16) -> Engine:
    """An `Engine` for a loaded `ModelPair`.

    Args:
        pair: `mlx_spec.models.ModelPair` (target, optional draft, tokenizer, vocab widths).
        drafter: "model" (needs pair.draft), "ngram", "none", or None for "model" when a
            draft model is loaded and "ngram" otherwise.
    """
    if drafter is None:
        drafter = "model" if pair.draft is not None else "ngram"
    if drafter not in DRAFTERS:
        raise MlxSpecError(f"unknown drafter {drafter!r}: choose one of {', '.join(DRAFTERS)}")
    if drafter == "model":
        if pair.draft is None:
            raise MlxSpecError("--drafter model needs a draft model (--draft-model or a preset with one)")
        chosen = ModelDrafter(pair.draft.model, pair.vocab_size_target)
    elif drafter == "ngram":
        chosen = NgramDrafter()
    else:
        chosen = None
    eos_ids = set(getattr(pair.tokenizer, "eos_token_ids", None) or [])
    return Engine(pair.target.model, chosen, eos_ids=eos_ids, max_gamma=max_gamma)


def context_bucket(tokens: int) -> int:
    """Cost curves are measured at powers of two from 256 to 4096 tokens of context."""
    bucket = 256
    while bucket < min(tokens, 4096):
        bucket *= 2
    return bucket


def gamma_policy(
    gamma: Union[int, str],
    engine: Engine,
    *,
    context: int = 256,
    refresh: bool = False,
    progress: Optional[Callable[[int, int], None]] = None,
) -> GammaPolicy:
    """`FixedGamma(n)` for an integer, `AutoGamma` from the measured cost curve for "auto"
    (measured once per pair and machine, then read from the cache)."""
    if isinstance(gamma, str) and gamma != "auto":
        try:
            gamma = int(gamma)
        except ValueError:
            raise MlxSpecError(f"--gamma must be a whole number or 'auto', not {gamma!r}") from None
    if gamma == "auto":
        if engine.drafter is None:
            return FixedGamma(0)
        max_gamma = min(MAX_AUTO_GAMMA, engine.max_gamma)
        draft_model = getattr(engine.drafter, "model", None)
        costs = load_or_measure(
            engine.target, draft_model, max_width=max_gamma + 1,
            context=context_bucket(context), refresh=refresh, progress=progress,
        )
        return AutoGamma(costs, max_gamma=max_gamma)
    if not 0 <= gamma <= engine.max_gamma:
        raise MlxSpecError(f"--gamma must be between 0 and {engine.max_gamma}, or 'auto'")
    return FixedGamma(gamma)
