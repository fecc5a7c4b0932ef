"""Models other tools already downloaded, as `load_model` sources:

    ollama:NAME[:TAG]          Ollama's manifest for NAME:TAG (tag "latest" when left out);
                               its GGUF model layer is the target, its draft layer the draft,
                               its params' `draft_num_predict` the default γ (see `ollama`)
    ollama:NAME[:TAG]#draft    that manifest's draft layer alone
    lmstudio:PUBLISHER/MODEL   LM Studio's folder for it: an MLX folder, or its one GGUF file
    lmstudio:PUBLISHER/MODEL/FILE.gguf   one GGUF file of several (see `lmstudio`)

Nothing here loads weights: it finds files and reads small headers, so `check_source` can
refuse what cannot run before anything slow happens; `list_local` says what is on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading import hub, lmstudio, ollama
from mlx_spec.loading.gguf_header import gguf_problem, read_gguf_header
from mlx_spec.models.drafts import draft_family

OLLAMA_PREFIX, LMSTUDIO_PREFIX = ollama.PREFIX, lmstudio.PREFIX


def is_store_source(source: str | None) -> bool:
    """Whether `source` names a model in Ollama's store or LM Studio's folder."""
    return bool(source) and source.startswith((OLLAMA_PREFIX, LMSTUDIO_PREFIX))


# ---------------------------------------------------------------------------------------
# What `load_model` and the CLI ask
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreFile:
    """Where a store source's weights are: a GGUF file (with its sha256 when the store
    names blobs by it) or a model folder."""

    path: Path
    is_gguf: bool
    sha256: str | None = None


def locate(source: str) -> StoreFile:
    """The weights `source` (ollama:… or lmstudio:…) names, refusing in one line what
    mlx-spec cannot read (the message names the format).

    Raises:
        ModelLoadError: not found, or stored in a format or architecture we cannot read.
    """
    if source.startswith(OLLAMA_PREFIX):
        name = source[len(OLLAMA_PREFIX):]
        wants_draft = name.endswith(ollama.DRAFT_SUFFIX)
        model = ollama.find(name.removesuffix(ollama.DRAFT_SUFFIX))
        if wants_draft:
            problem = model.draft_problem() or (None if model.draft else "its manifest has no draft layer")
            if problem:
                raise ModelLoadError(f"{source}: {problem}")
            return StoreFile(model.draft, True, model.draft_digest)
        problem = model.problem()
        if problem:
            raise ModelLoadError(f"{source}: {problem}")
        return StoreFile(model.model, True, model.model_digest)
    model = lmstudio.find(source[len(LMSTUDIO_PREFIX):])
    if model.gguf is None:
        return StoreFile(model.folder, False)
    problem = gguf_problem(read_gguf_header(model.gguf))
    if problem:
        raise ModelLoadError(f"{source} is {problem}")
    return StoreFile(model.gguf, True)


@dataclass(frozen=True)
class StoreDefaults:
    """What a store's model file says about drafting: the draft source and γ (0: the
    model file turns drafting off)."""

    draft: str | None
    gamma: int | None


def drafting_defaults(source: str) -> StoreDefaults:
    """For ollama:NAME, its draft layer (as "ollama:NAME#draft") and draft_num_predict;
    nothing for other sources.

    Ollama itself drafts with a separate draft layer at draft_num_predict tokens (4 when
    the params leave it out, server/routes.go), and with no draft layer only when the
    model GGUF carries MTP tensors and the params set draft_num_predict.

    Raises:
        ModelLoadError: the model drafts in a way mlx-spec cannot run (MTP tensors inside
            the model GGUF, or a draft in a format we cannot read).
    """
    if not source.startswith(OLLAMA_PREFIX) or source.endswith(ollama.DRAFT_SUFFIX):
        return StoreDefaults(None, None)
    model = ollama.find(source[len(OLLAMA_PREFIX):])
    if model.problem():
        return StoreDefaults(None, None)  # locate() refuses it with the reason
    problem = model.draft_problem()
    if problem:
        raise ModelLoadError(f"{model.source}: {problem}; run without it with --drafter ngram or --drafter none")
    if model.draft is None:
        header = read_gguf_header(model.model)
        if header.mtp_layers and model.draft_num_predict:
            raise ModelLoadError(f"{model.source} drafts with MTP tensors inside its model GGUF "
                                 f"({header.mtp_layers} nextn_predict_layers), which mlx-spec cannot "
                                 "run yet; use --drafter ngram or --drafter none")
        return StoreDefaults(None, None)
    gamma = ollama.DEFAULT_DRAFT_TOKENS if model.draft_num_predict is None else model.draft_num_predict
    return StoreDefaults(model.source + ollama.DRAFT_SUFFIX, gamma)


# ---------------------------------------------------------------------------------------
# `models list --local`
# ---------------------------------------------------------------------------------------


@dataclass
class LocalModel:
    """A model on disk that mlx-spec can run (`problem` None) or cannot (why)."""

    source: str  # what to pass to -m
    store: str  # "embedded" (the PyPI package) | "hf" | "ollama" | "lmstudio"
    format: str  # e.g. "MLX gemma3_text", "GGUF gemma3 Q4_K_M"
    size: int  # bytes on disk (target and its draft together for Ollama)
    draft: str | None = None  # the model file's own draft, e.g. "GGUF gemma3, γ 3"
    draft_size: int = 0
    problem: str | None = None


def list_local() -> list[LocalModel]:
    """What the HF cache, Ollama's store and LM Studio's folder hold, each marked with
    whether mlx-spec can run it (the embedded default: `sources.embedded_entry`). Reads only
    small files and GGUF headers."""
    found = []
    for repo_id, folder, size in hub.cached_models():
        ggufs = lmstudio.model_ggufs(folder)
        if ggufs and not any(folder.glob("*.safetensors")):  # a GGUF repo: -m takes each file's path
            found.extend(_gguf_entry(str(p), "hf", p, p.stat().st_size) for p in ggufs)
        else:
            found.append(_folder_entry(repo_id, "hf", folder, size))
    for model in ollama.list_models():
        found.append(_ollama_entry(model))
    for model in lmstudio.list_models():
        if model.gguf is None:
            found.append(_folder_entry(model.source, "lmstudio", model.folder, model.size))
        else:
            found.append(_gguf_entry(model.source, "lmstudio", model.gguf, model.size))
    return found


def _folder_entry(source: str, store: str, folder: Path, size: int) -> LocalModel:
    try:
        config = json.loads((folder / "config.json").read_text())
        model_type = str(config["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return LocalModel(source, store, "?", size, problem="no readable config.json")
    entry = LocalModel(source, store, f"MLX {model_type}", size)
    quant = config.get("quantization") or {}
    if quant.get("bits"):
        entry.format += f" {quant['bits']}-bit"
    if not any(folder.glob("*.safetensors")):
        weights = sorted({p.suffix for p in folder.iterdir() if p.suffix in (".gguf", ".bin", ".pt", ".pth")})
        entry.problem = f"no safetensors weights ({', '.join(weights) or 'none'})"
    elif not _runs_model_type(config):
        entry.problem = f"mlx-lm has no '{model_type}' architecture"
    return entry


def _runs_model_type(config: dict) -> bool:
    import importlib.util

    if draft_family(config) is not None:
        return True
    from mlx_lm.utils import MODEL_REMAPPING  # imports transformers (~1 s); listing only

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None


def _gguf_entry(source: str, store: str, path: Path, size: int, file_type: str | None = None) -> LocalModel:
    try:
        header = read_gguf_header(path)
    except ModelLoadError:
        return LocalModel(source, store, "GGUF ?", size, problem="unreadable GGUF file")
    file_type = header.file_type or file_type
    label = f"GGUF {header.architecture}" + (f" {file_type}" if file_type else "")
    problem = gguf_problem(header)
    return LocalModel(source, store, label, size, problem=f"it is {problem}" if problem else None)


def _ollama_entry(model: ollama.OllamaModel) -> LocalModel:
    size = model.sizes.get("model", 0) + model.sizes.get("draft", 0)
    problem = model.problem()
    if model.model is None or not model.model.is_file():
        return LocalModel(model.source, "ollama", model.model_format or "?", size, problem=problem)
    entry = _gguf_entry(model.source, "ollama", model.model, size, model.file_type)
    entry.problem = problem
    if model.draft is not None or model.draft_format is not None:
        draft_problem = model.draft_problem()
        if draft_problem is not None or model.draft is None:
            entry.draft = f"{model.draft_format or 'GGUF'} (cannot run)"
        else:
            header = read_gguf_header(model.draft)
            gamma = ollama.DEFAULT_DRAFT_TOKENS if model.draft_num_predict is None else model.draft_num_predict
            entry.draft = f"GGUF {header.architecture}, γ {gamma}"
        entry.draft_size = model.sizes.get("draft", 0)
    return entry
