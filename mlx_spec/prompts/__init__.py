"""Prompt text as users give it, and the committed benchmark prompts: short, long, window
(longer than a 512-token sliding window in the Gemma tokenizer) and quote (asks for a
passage to be copied, where prompt-lookup drafting shines)."""

from __future__ import annotations

from pathlib import Path

from mlx_spec.errors import MlxSpecError

PROMPT_DIR = Path(__file__).parent
REPLACEMENT = "\ufffd"


def valid_text(text) -> tuple[str, int]:
    """(text, how many characters were replaced): bytes that are not UTF-8, and the lone
    surrogates Python uses to carry such bytes in arguments and some stdins, become U+FFFD
    (tokenizers reject lone surrogates)."""
    if isinstance(text, bytes):
        decoded = text.decode("utf-8", "replace")
        return decoded, decoded.count(REPLACEMENT) - text.count(REPLACEMENT.encode())
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        cleaned = "".join(REPLACEMENT if "\ud800" <= ch <= "\udfff" else ch for ch in text)
        return cleaned, sum("\ud800" <= ch <= "\udfff" for ch in text)


def committed_prompts() -> dict[str, str]:
    """The fixed bench prompts by name."""
    return {p.stem: p.read_text() for p in sorted(PROMPT_DIR.glob("*.txt"))}


def resolve_prompt(spec: str) -> tuple[str, str, int]:
    """(name, text, characters replaced by `valid_text`) for a committed prompt name,
    '@file', or literal text."""
    prompts = committed_prompts()
    if spec in prompts:
        return spec, prompts[spec], 0
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            return (path.name, *valid_text(path.read_bytes()))
        except OSError as error:
            raise MlxSpecError(f"cannot read prompt file {path}: {error.strerror}") from None
    if not spec.strip():
        raise MlxSpecError("the prompt is empty")
    return ("custom", *valid_text(spec))
