"""Tiny Ollama stores and LM Studio folders, laid out as the real tools write them.

Ollama (its source: manifest/manifest.go WriteManifest, manifest/layer.go NewLayer,
server/create.go): manifests/registry.ollama.ai/library/NAME/TAG is a Docker v2 manifest
whose config and layers name blobs/sha256-<hex of the blob's bytes>; layer media types
application/vnd.ollama.image.{model,draft,params,template,license,tensor}.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import mlx.core as mx
import pytest
from conftest import greedy_reference

import mlx_spec.loading.gguf_tensors as gguf_tensors
from mlx_spec.loading import load_model

MANIFEST_MEDIA = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA = "application/vnd.docker.container.image.v1+json"
IMAGE = "application/vnd.ollama.image."


def _blob(root: Path, data: bytes, media: str, **extra) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / f"sha256-{digest}").write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data), **extra}


def write_ollama_model(root: Path, name: str, tag: str, *, model: Path | None = None,
                       draft: Path | None = None, params: dict | None = None,
                       config: dict | None = None, tensors: dict | None = None,
                       namespace: str = "library") -> Path:
    """One model in an Ollama store at `root` (what OLLAMA_MODELS points to).

    Args:
        model / draft: GGUF files copied in as the model and draft layers.
        params: the params layer's JSON (e.g. {"draft_num_predict": 3}).
        config: the config blob's JSON (model_format, model_family, draft, ...).
        tensors: name -> bytes, written as .tensor layers (Ollama's safetensors format).
    Returns:
        The manifest file.
    """
    layers = []
    if model is not None:
        layers.append(_blob(root, model.read_bytes(), IMAGE + "model"))
    if draft is not None:
        layers.append(_blob(root, draft.read_bytes(), IMAGE + "draft"))
    for tensor_name, data in (tensors or {}).items():
        layers.append(_blob(root, data, IMAGE + "tensor", name=tensor_name))
    layers.append(_blob(root, b"{{ .Prompt }}", IMAGE + "template"))
    layers.append(_blob(root, b"Gemma Terms of Use", IMAGE + "license"))
    if params is not None:
        layers.append(_blob(root, json.dumps(params).encode(), IMAGE + "params"))
    config_json = {"model_format": "gguf", "model_family": "gemma3", "model_families": ["gemma3"],
                   "model_type": "1M", "file_type": "Q8_0", "architecture": "amd64", "os": "linux",
                   **(config or {})}
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA,
                "config": _blob(root, json.dumps(config_json).encode(), CONFIG_MEDIA),
                "layers": layers}
    path = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


def write_header_only_gguf(path: Path, architecture: str, **uint32_keys: int) -> Path:
    """A GGUF file with metadata and no tensors: enough to be refused by its header.
    `uint32_keys` add "{architecture}.{key}" fields (e.g. nextn_predict_layers=1)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    for key, value in uint32_keys.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PROMPT = "the cat and the hat"


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Empty Ollama store, LM Studio folder, HF cache and mlx-spec cache; float32 import
    storage so the imported model equals the reference exactly."""
    paths = {name: tmp_path / name for name in ("ollama", "lmstudio", "hf", "cache")}
    monkeypatch.setenv("OLLAMA_MODELS", str(paths["ollama"]))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(paths["lmstudio"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(paths["hf"]))
    monkeypatch.setenv("MLX_SPEC_CACHE", str(paths["cache"]))
    monkeypatch.delenv("MLX_SPEC_DEBUG", raising=False)
    monkeypatch.setattr(gguf_tensors, "STORAGE_DTYPE", mx.float32)
    return paths


def plain_text(reference, tokenizer_source, max_tokens, prompt=PROMPT):
    """What plain greedy decoding of `reference` (mlx-lm's generate_step) writes for the
    prompt, cut at the first end-of-turn id as the CLI cuts it; the tokenizer is the one
    `tokenizer_source` (a .gguf file or model folder) loads with."""
    # mlx-lm's own tokenizer (for_chat), not a GGUF import's FastTokenizer
    tokenizer = load_model(str(tokenizer_source), progress=False, for_chat=True).tokenizer
    ids = greedy_reference(reference, tokenizer.encode(prompt), max_tokens)
    cut = next((i for i, t in enumerate(ids) if t in tokenizer.eos_token_ids), len(ids))
    detokenizer = tokenizer.detokenizer  # byte tokens join into characters as they stream
    detokenizer.reset()
    for token in ids[:cut]:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text
