"""Presets: named target + draft pairs with default γ and sampling settings (presets.toml)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from mlx_spec.errors import MlxSpecError, UsageError


@dataclass(frozen=True)
class Preset:
    """One named configuration.

    Attributes:
        name: the preset's key in presets.toml.
        target: target model source (see `load_model`).
        draft: draft model source, or None when the drafter needs no model.
        drafter: a name in the drafter registry (`mlx_spec.drafters.DRAFTERS`) or "none";
            checked where the preset is used (`runner.resolve_choice`).
        gamma: draft tokens per round, or "auto" to let the γ policy choose.
        temperature, top_p, top_k, min_p: sampling defaults (0 temperature is greedy).
        description: one line for `mlx-spec models list`.
        family: model family ("gemma3", "gemma4"), for grouping and notes.
        chat: whether `generate` wraps prompts in the chat template by default; False for
            base models, which continue text rather than answer turns.
        chat_template: a built-in template's name or a file, used in place of the model's
            own where --chat-template names none (a base model's: "qa").
    """

    name: str
    target: str
    draft: str | None
    drafter: str
    gamma: int | str
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    description: str
    family: str = ""
    chat: bool = True
    chat_template: str | None = None


def list_presets() -> list[Preset]:
    """All presets, in file order ("default" first)."""
    return list(_load().values())


def get_preset(name: str) -> Preset:
    """The preset called `name`.

    Raises:
        UsageError: no such preset (the message lists the known ones).
    """
    presets = _load()
    if name not in presets:
        raise UsageError(f"unknown preset '{name}' (known: {', '.join(presets)})", flag="--preset")
    return presets[name]


@lru_cache(maxsize=1)
def _load() -> dict[str, Preset]:
    text = resources.files(__name__).joinpath("presets.toml").read_text(encoding="utf-8")
    return {name: _parse(name, table) for name, table in tomllib.loads(text).items()}


def _parse(name: str, table: dict) -> Preset:
    known = set(Preset.__dataclass_fields__) - {"name"}
    unknown = set(table) - known
    if unknown:
        raise MlxSpecError(f"preset '{name}' has unknown fields: {', '.join(sorted(unknown))}")
    preset = Preset(
        name=name,
        target=table["target"],
        draft=table.get("draft"),
        drafter=table.get("drafter", "model" if table.get("draft") else "none"),
        gamma=table.get("gamma", "auto"),
        temperature=float(table.get("temperature", 0.0)),
        top_p=float(table.get("top_p", 1.0)),
        top_k=int(table.get("top_k", 0)),
        min_p=float(table.get("min_p", 0.0)),
        description=table.get("description", ""),
        family=table.get("family", ""),
        chat=bool(table.get("chat", True)),
        chat_template=table.get("chat_template"),
    )
    if not (preset.gamma == "auto" or (isinstance(preset.gamma, int) and preset.gamma >= 0)):
        raise MlxSpecError(f"preset '{name}': gamma must be a non-negative integer or 'auto'")
    return preset
