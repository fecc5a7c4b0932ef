"""A model folder's tokenizer: mlx-lm's, or for a GGUF import's folder a `FastTokenizer` that
behaves as one, with Gemma 3's and Gemma 4's turn ends and chat templates ensured."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading import gguf_import
from mlx_spec.loading.chat_templates import GEMMA4_CHAT_TEMPLATE, GEMMA_CHAT_TEMPLATE
from mlx_spec.loading.fast_tokenizer import FastTokenizer, NotSentencePiece, fast_loadable

if TYPE_CHECKING:  # importing it costs transformers (~1 s); see fast_tokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                    "*.tiktoken", "tiktoken.model")

# Per family (model_type prefix): the tokens that end a turn (generation stops there, as the
# checkpoints' generation_config.json says) and the template used when a checkpoint has none.
_TURN_ENDS = {"gemma3": ("<end_of_turn>",), "gemma4": ("<turn|>", "<|tool_response>")}
_CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE, "gemma4": GEMMA4_CHAT_TEMPLATE}


def load_tokenizer(path: Path, config: dict, *, optional: bool = False) -> TokenizerWrapper | None:
    """mlx-lm's tokenizer for the folder (for a GGUF import's folder, a `FastTokenizer`
    that behaves as one), with Gemma 3's and Gemma 4's turn ends and chat templates ensured."""
    return with_turn_ends(read_tokenizer(path, config, optional), config)


def read_tokenizer(path: Path, config: dict, optional: bool, fast: bool = True,
                   chat_template: str | None = None):
    """The folder's tokenizer as it is stored (`fast`: a GGUF import's `FastTokenizer` where
    it can be one); None for a folder without one when `optional`. `chat_template`
    replaces the stored template (mlx-lm's tokenizer then infers its tool-call syntax from it)."""
    # Without any of these transformers silently builds an empty tokenizer for the model type.
    if not any(any(path.glob(pattern)) for pattern in _TOKENIZER_FILES):
        if optional:
            return None
        raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, "
                             "tokenizer_config.json)")
    try:
        tokenizer_config = fast_loadable(path) if fast and gguf_import.is_imported(path) else None
        if tokenizer_config is not None:
            try:
                return FastTokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id"),
                                     chat_template=chat_template)
            except NotSentencePiece:
                pass  # mlx-lm picks its detokenizer
        from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

        extra = {"chat_template": chat_template} if chat_template is not None else None
        return mlx_lm_load_tokenizer(path, tokenizer_config_extra=extra, eos_token_ids=config.get("eos_token_id"))
    except Exception as error:  # transformers raises many types for a bad tokenizer
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {reason}") from None


def with_turn_ends(tokenizer, config: dict):
    """`tokenizer` with its Gemma family's turn ends as end tokens and, where it has none,
    the family's chat template."""
    family = str(config.get("model_type", ""))[:6]
    if tokenizer is not None and family in _TURN_ENDS:
        # Instruction-tuned Gemma ends turns with <end_of_turn> (Gemma 3) or <turn|> (Gemma 4,
        # which also hands over to a tool with <|tool_response>); generation must stop there.
        for token in _TURN_ENDS[family]:
            if tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id:  # get_vocab: 0.3 s
                tokenizer.add_eos_token(token)
        if not tokenizer.has_chat_template:
            tokenizer._tokenizer.chat_template = _CHAT_TEMPLATES[family]
            tokenizer.has_chat_template = True
    return tokenizer
