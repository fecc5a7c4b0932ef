"""Ollama's model store, read as Ollama's own source writes it.

Files read (github.com/ollama/ollama): envconfig/config.go `Models` ($OLLAMA_MODELS, else
~/.ollama/models; the Linux install script gives the service user the home /usr/share/ollama),
types/model/name.go (NAME[:TAG] fills in registry.ollama.ai / library / latest; names compare
ignoring case; `Filepath` is HOST/NAMESPACE/MODEL/TAG), manifest/manifest.go and paths.go
(manifests/HOST/NAMESPACE/MODEL/TAG is a Docker v2 manifest: a config and layers, each a
mediaType, a digest and a size; blobs/sha256-<hex> holds each), server/images.go `GetModel`
(what each layer media type means), types/model/config.go (the config blob: model_format,
model_family, file_type, draft), api/types.go and server/routes.go (draft_num_predict: 4 by
default with a draft layer, 0 without one unless set), llm/llama_server.go (a draft layer goes
to llama-server as --spec-draft-model with --spec-type draft-mtp, or draft-dflash for a
"dflash" GGUF; a model GGUF with nextn_predict_layers > 0 drafts with its own MTP tensors).

Layer media types, application/vnd.ollama.image.*: model (the GGUF), draft (a draft GGUF),
params (JSON options, e.g. {"draft_num_predict": 3}), template, system, license, projector,
adapter; and tensor (+ json) layers for a model imported from safetensors for Ollama's MLX
engine (config model_format "safetensors", a draft's tensors prefixed "draft."), which we
cannot read.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading.gguf_header import gguf_problem, read_gguf_header

PREFIX = "ollama:"
DRAFT_SUFFIX = "#draft"
MODEL_LAYER = "application/vnd.ollama.image.model"
DRAFT_LAYER = "application/vnd.ollama.image.draft"
PARAMS_LAYER = "application/vnd.ollama.image.params"
TENSOR_LAYER = "application/vnd.ollama.image.tensor"
# What Ollama drafts per step with a draft layer when the params do not say (api.DefaultOptions).
DEFAULT_DRAFT_TOKENS = 4
_HOST, _NAMESPACE, _TAG = "registry.ollama.ai", "library", "latest"
_DIGEST = re.compile(r"^sha256[:-]([0-9a-fA-F]{64})$")


def roots() -> list[Path]:
    """$OLLAMA_MODELS alone when set (as Ollama does), else the user's ~/.ollama/models and
    the Linux service's /usr/share/ollama/.ollama/models, in that order."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


@dataclass
class OllamaModel:
    """One model in Ollama's store, as its manifest describes it.

    Attributes:
        name: the name as the user gave it (without "ollama:").
        manifest: the manifest file.
        model_format: the config's model_format ("gguf", "safetensors"), or None.
        model: the GGUF blob of the model layer, or None (a safetensors-tensor model).
        model_digest: its sha256 (the blob's name), so an import need not hash it again.
        draft / draft_digest: the draft layer's blob and sha256, or None.
        draft_num_predict: the params' draft_num_predict (Ollama's γ), or None if unset.
        sizes: bytes per role ("model", "draft", "total"), from the manifest.
    """

    name: str
    manifest: Path
    model_format: str | None
    model: Path | None
    model_digest: str | None
    draft: Path | None = None
    draft_digest: str | None = None
    draft_format: str | None = None
    draft_num_predict: int | None = None
    file_type: str | None = None  # the config's quantization label, e.g. "Q4_K_M"
    sizes: dict = field(default_factory=dict)

    @property
    def source(self) -> str:
        return PREFIX + self.name

    def problem(self) -> str | None:
        """Why mlx-spec cannot run the model layer (a clause to follow "NAME: "), or None."""
        if self.model is None:
            fmt = self.model_format or "a format without a GGUF model layer"
            return (f"it is stored in Ollama's {fmt} format (tensor layers for its MLX engine), "
                    "which mlx-spec cannot read; it reads Ollama models stored as GGUF")
        return self._gguf_problem(self.model, "its model")

    def draft_problem(self) -> str | None:
        """Why mlx-spec cannot run the draft layer, or None (also None without a draft)."""
        if self.draft is None:
            if self.draft_format is not None:  # a safetensors draft, stored as prefixed tensors
                return f"its draft is stored in Ollama's {self.draft_format} format, which mlx-spec cannot read"
            return None
        return self._gguf_problem(self.draft, "its draft")

    def _gguf_problem(self, blob: Path, what: str) -> str | None:
        if not blob.is_file():
            return f"{what} blob {blob} is missing; pull the model again with `ollama pull {self.name}`"
        problem = gguf_problem(read_gguf_header(blob))
        return f"{what} is {problem}" if problem else None


def parse_ollama_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) as Ollama's ParseName fills them in: "gemma4:12b" is
    registry.ollama.ai/library/gemma4:12b; "user/model" is registry.ollama.ai/user/model:latest."""
    rest, tag = name, _TAG
    if rest.rfind(":") > rest.rfind("/"):
        rest, tag = rest.rsplit(":", 1)
    parts = rest.split("/")
    # Each part names a folder under manifests/: none may be empty, "." or "..", nor hold a
    # backslash (Ollama's own names allow none of these).
    if len(parts) > 3 or any(p in ("", ".", "..") or "\\" in p for p in parts + [tag]):
        raise ModelLoadError(f"'{PREFIX}{name}' is not an Ollama model name (NAME[:TAG], "
                             "e.g. ollama:gemma4:12b)")
    parts = [_HOST, _NAMESPACE][: 3 - len(parts)] + parts
    return parts[0], parts[1], parts[2], tag


def find(name: str) -> OllamaModel:
    """The model `name` (NAME[:TAG]) in the first Ollama store that has it.

    Raises:
        ModelLoadError: no store has it, or its manifest is damaged.
    """
    host, namespace, model, tag = parse_ollama_name(name)
    folders = roots()
    for root in folders:
        manifest = _manifest_path(root / "manifests", host, namespace, model, tag)
        if manifest is not None:
            return read_ollama_manifest(manifest, root, name)
    where = " or ".join(str(r) for r in folders)
    raise ModelLoadError(f"Ollama has no model '{name}' in {where} (pull it with `ollama pull {name}`, "
                         "or set OLLAMA_MODELS to the store's folder)")


def _manifest_path(manifests: Path, *parts: str) -> Path | None:
    """manifests/HOST/NAMESPACE/MODEL/TAG; Ollama compares names ignoring case."""
    exact = manifests.joinpath(*parts)
    if exact.is_file():
        return exact
    folder = manifests
    for part in parts:
        if not folder.is_dir():
            return None
        folder = next((p for p in folder.iterdir() if p.name.lower() == part.lower()), None)
        if folder is None:
            return None
    return folder if folder.is_file() else None


def read_ollama_manifest(manifest: Path, root: Path, name: str) -> OllamaModel:
    """Parse one manifest (and its config and params blobs) into an `OllamaModel`."""
    try:
        data = json.loads(manifest.read_text())
        layers = list(data["layers"])
        config_digest = (data.get("config") or {}).get("digest")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"Ollama's manifest {manifest} is damaged ({error})") from None
    config = _json_blob(root, config_digest) if config_digest else {}
    found = OllamaModel(name=name, manifest=manifest, model_format=config.get("model_format"),
                        model=None, model_digest=None, file_type=config.get("file_type"))
    sizes = {"model": 0, "draft": 0, "total": 0}
    for layer in layers:
        media, digest, size = layer.get("mediaType"), layer.get("digest", ""), int(layer.get("size") or 0)
        sizes["total"] += size
        if media == MODEL_LAYER and found.model is None:
            found.model, found.model_digest = _blob(root, digest), _hex(digest)
            sizes["model"] += size
        elif media == DRAFT_LAYER and found.draft is None:
            found.draft, found.draft_digest = _blob(root, digest), _hex(digest)
            sizes["draft"] += size
        elif media == TENSOR_LAYER:
            sizes["draft" if str(layer.get("name", "")).startswith("draft.") else "model"] += size
        elif media == PARAMS_LAYER:
            value = _json_blob(root, digest).get("draft_num_predict")
            found.draft_num_predict = int(value) if isinstance(value, (int, float)) else None
    draft_config = config.get("draft") or {}
    if found.draft is None and draft_config.get("model_format"):
        found.draft_format = draft_config["model_format"]
    found.sizes = sizes
    return found


def _hex(digest: str) -> str | None:
    match = _DIGEST.match(digest or "")
    return match.group(1).lower() if match else None


def _blob(root: Path, digest: str) -> Path:
    hex_digest = _hex(digest)
    if hex_digest is None:
        raise ModelLoadError(f"Ollama's manifest names a blob by '{digest}', not a sha256 digest")
    return root / "blobs" / f"sha256-{hex_digest}"


def _json_blob(root: Path, digest: str) -> dict:
    try:
        value = json.loads(_blob(root, digest).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def list_models() -> list[OllamaModel]:
    """Every model in every Ollama store (manifests/HOST/NAMESPACE/MODEL/TAG), named as
    Ollama shows them (host and namespace left out when they are the defaults)."""
    found, seen = [], set()
    for root in roots():
        manifests = root / "manifests"
        for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else ():
            if not manifest.is_file():
                continue
            host, namespace, model, tag = manifest.relative_to(manifests).parts
            name = f"{model}:{tag}"
            if namespace != _NAMESPACE or host != _HOST:
                name = f"{namespace}/{name}" if host == _HOST else f"{host}/{namespace}/{name}"
            if name in seen:
                continue
            seen.add(name)
            try:
                found.append(read_ollama_manifest(manifest, root, name))
            except ModelLoadError:
                continue
    return found
