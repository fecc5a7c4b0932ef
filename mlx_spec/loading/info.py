"""What a model is, without running it: architecture, size, quantization, attention layout,
vocabulary. Weights are loaded lazily, so describing a 27B checkpoint reads only its headers."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec.loading import hub
from mlx_spec.loading.chat_templates import GEMMA_CHAT_TEMPLATE
from mlx_spec.loading.checkpoints import context_length, load_folder
from mlx_spec.loading.sources import DEFAULT_SOURCE, resolve_source
from mlx_spec.loading.tokenizer_loading import load_tokenizer
from mlx_spec.models.gemma4_assistant import is_assistant_config


def model_info(source: str | None, *, progress: bool = True, download: bool = True) -> dict:
    """Describe the model `source` names (see `load_model` for the accepted forms).

    Args:
        source: model source; None or "default" is the embedded model.
        progress: show progress bars when importing or downloading.
        download: fetch Hub models that are not cached; if False they must be cached.
    Returns:
        A JSON-ready dict (see `describe`).
    """
    if download:
        path, kind = resolve_source(source, progress=progress)
    else:
        with hub.forced_offline():
            path, kind = resolve_source(source, progress=progress)
    model, config = load_folder(path, lazy=True)
    tokenizer = load_tokenizer(path, config, optional=is_assistant_config(config))
    return describe(model, tokenizer, config, source=source or DEFAULT_SOURCE, path=path,
                    kind=kind)


def describe(model, tokenizer, config: dict, *, source: str, path: Path, kind: str) -> dict:
    """Facts about a loaded (possibly lazy) mlx-lm model and its tokenizer.

    Returns:
        dict with source, kind, path, architecture, parameters, weight_bytes, dtype,
        quantization, layers, sliding_window, sliding_window_pattern, context_length,
        vocab_width, tokenizer_size, chat_template, eos_token_ids (and gguf for imports).
    """
    from mlx_lm.utils import get_total_parameters

    text = config.get("text_config") or config  # multimodal Gemma configs nest the text model
    params = dict(tree_flatten(model.parameters()))
    floats = Counter()
    for value in params.values():
        if mx.issubdtype(value.dtype, mx.floating):
            floats[str(value.dtype).removeprefix("mlx.core.")] += value.size
    quant = config.get("quantization") or {}
    info = {
        "source": source,
        "kind": kind,
        "path": str(path),
        "architecture": config.get("model_type"),
        "text_architecture": text.get("model_type", config.get("model_type")),
        "parameters": int(get_total_parameters(model)),
        "weight_bytes": int(sum(v.nbytes for v in params.values())),
        "dtype": floats.most_common(1)[0][0] if floats else None,
        "quantization": ({"bits": quant.get("bits"), "group_size": quant.get("group_size"),
                          "mode": quant.get("mode", "affine")} if quant else None),
        "layers": len(model.layers),
        "sliding_window": text.get("sliding_window"),
        "sliding_window_pattern": _sliding_pattern(text),
        "context_length": context_length(config),
        "vocab_width": _vocab_width(params),
        # an MTP assistant may ship no tokenizer (it speaks its target's ids)
        "tokenizer_size": len(tokenizer._tokenizer) if tokenizer else None,
        "chat_template": _chat_template_kind(tokenizer) if tokenizer else None,
        "eos_token_ids": sorted(tokenizer.eos_token_ids) if tokenizer else [],
    }
    source_file = path / "mlx_spec_source.json"
    if source_file.exists():
        info["gguf"] = json.loads(source_file.read_text())
    return info


def _vocab_width(params: dict) -> int | None:
    """Rows of the output layer (the embedding when tied); quantization packs columns only."""
    for suffix in ("lm_head.weight", "embed_tokens.weight"):
        for name, value in params.items():
            if name.endswith(suffix):
                return int(value.shape[0])
    return None


def _sliding_pattern(text: dict):
    if "sliding_window_pattern" in text:
        return text["sliding_window_pattern"]
    layer_types = text.get("layer_types")
    if layer_types and "full_attention" in layer_types:  # newer configs list each layer
        return layer_types.index("full_attention") + 1
    return None


def _chat_template_kind(tokenizer) -> str:
    template = getattr(tokenizer._tokenizer, "chat_template", None)
    if template == GEMMA_CHAT_TEMPLATE:
        return "Gemma turn format (fallback)"
    return "yes" if tokenizer.has_chat_template else "no"
