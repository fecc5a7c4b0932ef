"""The committed benchmark prompts: short, long, window (longer than a 512-token sliding
window in the Gemma tokenizer) and quote (asks for a passage to be copied, where
prompt-lookup drafting shines)."""

from __future__ import annotations

from pathlib import Path

from mlx_spec.errors import MlxSpecError

PROMPT_DIR = Path(__file__).parent


def committed_prompts() -> dict[str, str]:
    """The fixed bench prompts by name."""
    return {p.stem: p.read_text() for p in sorted(PROMPT_DIR.glob("*.txt"))}


def resolve_prompt(spec: str) -> tuple[str, str]:
    """(name, text) for a committed prompt name, '@file', or literal text."""
    prompts = committed_prompts()
    if spec in prompts:
        return spec, prompts[spec]
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            return path.name, path.read_text()
        except OSError as error:
            raise MlxSpecError(f"cannot read prompt file {path}: {error.strerror}") from None
    if not spec.strip():
        raise MlxSpecError("the prompt is empty")
    return "custom", spec
