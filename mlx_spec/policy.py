"""Choosing γ, the number of draft tokens per round. γ = 0 is plain decoding."""

from __future__ import annotations

from typing import Protocol

from mlx_spec.stats import Stats


class GammaPolicy(Protocol):
    def choose(self, stats: Stats) -> int:
        """γ for the next round, given the statistics so far."""
        ...


class FixedGamma:
    def __init__(self, gamma: int):
        if gamma < 0:
            raise ValueError("gamma must be >= 0")
        self.gamma = gamma

    def choose(self, stats: Stats) -> int:
        return self.gamma

    def __repr__(self) -> str:
        return f"FixedGamma({self.gamma})"


def as_policy(gamma: "int | GammaPolicy") -> GammaPolicy:
    return FixedGamma(gamma) if isinstance(gamma, int) else gamma
