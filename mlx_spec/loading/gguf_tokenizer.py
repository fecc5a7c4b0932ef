"""The tokenizer of a GGUF import: `tokenizer.json` and `tokenizer_config.json` built from
the file's metadata with transformers' GGUF tokenizer conversion (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_spec.errors import ModelLoadError


def write_tokenizer(out: Path, meta: dict, arch_name: str, fallback_template: str | None):
    """tokenizer.json + tokenizer_config.json from the metadata, without torch."""
    from tokenizers.processors import TemplateProcessing

    try:  # transformers 5.x; its Gemma builder fixes the space tokens and merge order
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        raise ModelLoadError("importing a GGUF tokenizer needs a newer transformers "
                             "(tested with 5.24): pip install -U transformers") from None

    fields = {name: meta[f"tokenizer.{key}"]
              for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in meta}
    try:
        backend, _ = convert_gguf_tokenizer(arch_name, fields)
    except (KeyError, ValueError) as error:
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF metadata ({error})") from None
    tokens = fields["tokens"]

    def token(key):
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    if meta.get("tokenizer.ggml.model") == "gemma4":
        # llama.cpp's converter sets the flag, but Gemma 4's own tokenizer adds no BOS (its
        # chat template writes <bos>); transformers' GGUF loader follows the reference too.
        add_bos = False
    bos = token("bos_token_id")
    if bos is not None and add_bos:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        backend.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    # Compact, not pretty-printed: 14 MB instead of 33 MB for Gemma's 262k tokens, and every
    # load parses it (mlx-lm and transformers both do): 0.35 s of a warm run's ~6.5 s.
    backend.save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template") or fallback_template,
        "model_max_length": int(meta.get(f"{arch_name}.context_length", 32768)),
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}, indent=2))
