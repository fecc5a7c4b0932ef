"""Pairing a target with a draft: both must speak the same token ids.

Speculative decoding compares p (target) and q (draft) token by token, so the two tokenizers
must agree on every id they share. `check_compatible` runs the checks llama.cpp's
`common_speculative_are_compatible` runs, once, before any decoding: vocabulary type, BOS/EOS
handling, then the text of every shared token id. Vocabulary *widths* may differ (Gemma 3
checkpoints pad their output layer to 262144 or 262208 rows); they are recorded so the engine
can align p and q on the shared range.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_spec.errors import IncompatibleModelsError, ModelLoadError
from mlx_spec.models.drafts import draft_family
from mlx_spec.loading.loader import LoadedModel, load_model
from mlx_spec.loading.sources import DEFAULT_SOURCE, assistant_as_target
from mlx_spec.models import dflash, dflash2, dspark, eagle3
from mlx_spec.models.gemma4_assistant import is_assistant_config, target_text_model

if TYPE_CHECKING:  # importing it costs transformers (~1 s); see fast_tokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE: tokenizers further apart are different vocabularies.
MAX_VOCAB_SIZE_DIFFERENCE = 128


@dataclass
class ModelPair:
    """Target and optional draft model sharing one tokenizer.

    Attributes:
        target: the model whose distribution p the output follows.
        draft: the small model proposing tokens (q), or None for model-free drafters.
        tokenizer: the target's tokenizer; valid for the draft's ids too.
        (A Gemma 4 MTP assistant as the draft is checked against the target's sizes instead
        of a tokenizer it may not ship.)
        vocab_size_target: width of the target's logits (last dimension).
        vocab_size_draft: width of the draft's logits, or None without a draft.
        draft_on: across ranks (`distributed.load_pair`), where the draft model lives:
            "root" (rank 0 drafts and broadcasts) or "all" (every rank drafts); None alone.
    """

    target: LoadedModel
    draft: LoadedModel | None
    tokenizer: TokenizerWrapper
    vocab_size_target: int
    vocab_size_draft: int | None
    draft_on: str | None = None

    @property
    def shared_vocab_size(self) -> int:
        """Token ids both models score: compare p and q over [0, shared_vocab_size)."""
        if self.vocab_size_draft is None:
            return self.vocab_size_target
        return min(self.vocab_size_target, self.vocab_size_draft)


def load_pair(target: str | None, draft: str | None = None, *,
              draft_options: dict | None = None, **load_kwargs) -> ModelPair:
    """Load target and draft, check they are compatible, measure their logits widths.

    The same source named twice loads once: the LoadedModel is shared, which is safe because
    models hold no decoding state (the engine owns one cache per role).

    Args:
        target: source of the target model (see `load_model`; None is the embedded default).
        draft: source of the draft model, or None.
        draft_options: `load_model` keywords for the draft that differ from the target's
            (e.g. `{"quantize": 4}`).
        load_kwargs: `load_model` keywords for both (dtype, quantize, group_size, progress).
    Returns:
        The ModelPair.
    Raises:
        ModelLoadError: either model cannot be loaded.
        IncompatibleModelsError: the tokenizers differ (message names the first difference).
    """
    target_model = _load_as("target model", target, load_kwargs)
    if is_assistant(target_model):  # it has no forward of its own over tokens
        raise ModelLoadError(f"target model: {assistant_as_target(target)}")
    draft_model = None
    if draft is not None:
        draft_kwargs = {**load_kwargs, **(draft_options or {})}
        if _same_source(target, draft) and draft_kwargs == load_kwargs:
            draft_model = target_model
        else:
            draft_model = _load_as("draft model", draft, draft_kwargs)
        if is_assistant(draft_model):
            check_assistant(target_model, draft_model)
        elif is_block_draft(draft_model):
            check_block_draft(target_model, draft_model)
        else:
            check_compatible(target_model, draft_model)
    return ModelPair(
        target=target_model,
        draft=draft_model,
        tokenizer=target_model.tokenizer,
        vocab_size_target=output_width(target_model),
        vocab_size_draft=output_width(draft_model) if draft_model is not None else None,
    )


def _load_as(role: str, source: str | None, kwargs: dict) -> LoadedModel:
    """load_model, with errors saying which of the two models failed."""
    try:
        return load_model(source, **kwargs)
    except ModelLoadError as error:
        message = str(error)
        raise ModelLoadError(message if message.startswith(role) else f"{role}: {message}") from None


def _incompatible(detail: str) -> IncompatibleModelsError:
    return IncompatibleModelsError(
        f"the draft and target models do not share a tokenizer, so they cannot pair: {detail}")


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise IncompatibleModelsError naming the first difference between the tokenizers.

    Checks, in order: vocabulary type, BOS id and whether encode adds it, EOS id, the text
    of every token id both tokenizers have (all of them: ~0.2 s per 262k-token vocabulary),
    then that the vocabulary sizes are within MAX_VOCAB_SIZE_DIFFERENCE.
    """
    tok_tgt, tok_dft = target.tokenizer._tokenizer, draft.tokenizer._tokenizer
    if tok_tgt is tok_dft:
        return
    type_tgt, type_dft = _vocab_type(tok_tgt), _vocab_type(tok_dft)
    if type_tgt != type_dft:
        raise _incompatible(
            f"draft vocabulary type is {type_dft} but target vocabulary type is {type_tgt}")
    for role in ("bos", "eos"):
        id_tgt, id_dft = getattr(tok_tgt, f"{role}_token_id"), getattr(tok_dft, f"{role}_token_id")
        if id_tgt != id_dft:
            raise _incompatible(
                f"draft {role.upper()} token is {_describe(tok_dft, id_dft)} but target "
                f"{role.upper()} token is {_describe(tok_tgt, id_tgt)}")
    adds_tgt, adds_dft = _adds_bos(tok_tgt), _adds_bos(tok_dft)
    if adds_tgt != adds_dft:
        raise _incompatible(
            f"draft {'adds' if adds_dft else 'does not add'} BOS when encoding but target "
            f"{'does' if adds_tgt else 'does not'}")
    size_tgt, size_dft = len(tok_tgt), len(tok_dft)
    shared = min(size_tgt, size_dft)
    text_tgt = tok_tgt.convert_ids_to_tokens(list(range(shared)))
    text_dft = tok_dft.convert_ids_to_tokens(list(range(shared)))
    if text_tgt != text_dft:
        i = next(i for i, (t, d) in enumerate(zip(text_tgt, text_dft)) if t != d)
        raise _incompatible(
            f"draft token {i} is {text_dft[i]!r} but target token {i} is {text_tgt[i]!r}")
    if abs(size_tgt - size_dft) > MAX_VOCAB_SIZE_DIFFERENCE:
        raise _incompatible(
            f"draft tokenizer has {size_dft} tokens and target {size_tgt}; more than "
            f"{MAX_VOCAB_SIZE_DIFFERENCE} apart, so they are different vocabularies")


def is_assistant(loaded: LoadedModel | None) -> bool:
    """Whether `loaded` is a Gemma 4 MTP assistant (drafts over its target's caches)."""
    return loaded is not None and is_assistant_config(loaded.config)


# families of drafts that read the target's tap layers -> why one cannot draft for a target
TAPPING = {"dflash": dflash.target_mismatch, "dflash2": dflash2.target_mismatch, "eagle3": eagle3.target_mismatch,
           "dspark": dspark.target_mismatch}


def is_block_draft(loaded: LoadedModel | None) -> bool:
    """Whether `loaded` is a draft that reads the target's tap layers (DFlash, EAGLE-3),
    over the target's vocabulary."""
    return loaded is not None and draft_family(loaded.config) in TAPPING


def check_block_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """Such a draft reads its target's layer outputs (and its embedding and head, or ids):
    IncompatibleModelsError (one line) unless its hidden size, vocabulary and tap layers
    fit this target."""
    mismatch = TAPPING[draft_family(draft.config)](draft.model.args, target.model)
    if mismatch:
        raise IncompatibleModelsError(mismatch)
    if draft.tokenizer is not None:  # a release that ships the tokenizer: same ids?
        check_compatible(target, draft)


def check_assistant(target: LoadedModel, assistant: LoadedModel) -> None:
    """An MTP assistant reads its target's hidden state, embeddings and K/V: raise
    IncompatibleModelsError unless the target is a Gemma 4 of the sizes it was built for."""
    inner = target_text_model(target.model)
    if inner is None:
        raise IncompatibleModelsError(
            f"{assistant.source} is a Gemma 4 MTP assistant; it drafts for Gemma 4 targets only, "
            f"and the target is {target.config.get('model_type')}")
    args, text = inner.config, assistant.model.text_args
    expected = {"hidden size": (assistant.model.args.backbone_hidden_size, args.hidden_size),
                "vocabulary": (text.vocab_size, args.vocab_size),
                "sliding head size": (text.head_dim, args.head_dim),
                "full head size": (text.global_head_dim, args.global_head_dim)}
    for what, (built_for, actual) in expected.items():
        if built_for != actual:
            raise IncompatibleModelsError(
                f"the assistant was built for a target {what} of {built_for}; this target's is {actual}")
    if assistant.tokenizer is not None:  # a release that ships the tokenizer: same ids?
        check_compatible(target, assistant)


def output_width(loaded: LoadedModel) -> int:
    """Width of the model's logits, measured with a one-token forward pass (configs disagree
    on where they keep it, and padded heads make the tokenizer size unreliable)."""
    if is_assistant(loaded):  # no forward of its own: its logits are over its vocabulary
        return loaded.model.vocab_size
    if is_block_draft(loaded):  # its drafts are target ids
        return loaded.model.args.vocab_size
    token = loaded.tokenizer.bos_token_id or 0
    logits = loaded.model(mx.array([[token]]))
    return int(logits.shape[-1])


def _same_source(a: str | None, b: str | None) -> bool:
    def key(source):
        if source is None or source == DEFAULT_SOURCE:
            return DEFAULT_SOURCE
        path = Path(source).expanduser()
        return str(path.resolve()) if path.exists() else source

    return key(a) == key(b)


def _vocab_type(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return type(backend.model).__name__  # BPE, Unigram, WordPiece, WordLevel
    return type(tokenizer).__name__


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer.encode("a")
    return bool(ids) and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id


def _describe(tokenizer, token_id) -> str:
    if token_id is None:
        return "unset"
    return f"{token_id} ({tokenizer.convert_ids_to_tokens(token_id)!r})"
