"""Models other tools already downloaded: Ollama's store and LM Studio's models folder.

    ollama:NAME[:TAG]          Ollama's manifest for NAME:TAG (tag "latest" when left out);
                               its GGUF model layer is the target, its draft layer the draft,
                               its params' `draft_num_predict` the default γ
    ollama:NAME[:TAG]#draft    that manifest's draft layer alone
    lmstudio:PUBLISHER/MODEL   LM Studio's folder for it: an MLX folder, or its one GGUF file
    lmstudio:PUBLISHER/MODEL/FILE.gguf   one GGUF file of several

Ollama's layout, as its source writes it (manifest/paths.go, manifest/layer.go,
types/model/name.go, server/images.go): $OLLAMA_MODELS (default ~/.ollama/models; the Linux
service's home is /usr/share/ollama) holds manifests/HOST/NAMESPACE/MODEL/TAG (JSON, a
Docker v2 manifest whose config and layers name blobs by digest) and blobs/sha256-<hex>.
A layer's mediaType says what it is: application/vnd.ollama.image.model (the GGUF),
.draft (a draft model Ollama hands llama-server as --spec-draft-model), .params (JSON
options such as draft_num_predict), .template, .system, .license; a model Ollama imported
from safetensors for its MLX engine is instead a list of .tensor layers (config
model_format "safetensors"), which we cannot read.

Nothing here loads weights: it finds files and reads small headers, so `check_source` can
refuse what cannot run before anything slow happens.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mlx_spec.errors import ModelLoadError

OLLAMA_PREFIX = "ollama:"
LMSTUDIO_PREFIX = "lmstudio:"
DRAFT_SUFFIX = "#draft"

MODEL_LAYER = "application/vnd.ollama.image.model"
DRAFT_LAYER = "application/vnd.ollama.image.draft"
PARAMS_LAYER = "application/vnd.ollama.image.params"
TENSOR_LAYER = "application/vnd.ollama.image.tensor"
# What Ollama drafts per step with a draft layer when the params do not say (api.DefaultOptions).
OLLAMA_DEFAULT_DRAFT_TOKENS = 4
_OLLAMA_HOST, _OLLAMA_NAMESPACE, _OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
_DIGEST = re.compile(r"^sha256[:-]([0-9a-fA-F]{64})$")


def is_store_source(source: str | None) -> bool:
    """Whether `source` names a model in Ollama's store or LM Studio's folder."""
    return bool(source) and source.startswith((OLLAMA_PREFIX, LMSTUDIO_PREFIX))


# ---------------------------------------------------------------------------------------
# Where the stores are
# ---------------------------------------------------------------------------------------


def ollama_roots() -> list[Path]:
    """$OLLAMA_MODELS alone when set (as Ollama does), else the user's ~/.ollama/models and
    the Linux service's /usr/share/ollama/.ollama/models, in that order."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def lmstudio_roots() -> list[Path]:
    """$LMSTUDIO_MODELS alone when set (mlx-spec's, for a folder moved in LM Studio's
    settings), else ~/.lmstudio/models and the older ~/.cache/lm-studio/models."""
    if os.environ.get("LMSTUDIO_MODELS"):
        return [Path(os.environ["LMSTUDIO_MODELS"]).expanduser()]
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


# ---------------------------------------------------------------------------------------
# GGUF headers
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str
    file_type: str | None  # e.g. "Q4_K_M" (general.file_type), when recorded
    mtp_layers: int  # {arch}.nextn_predict_layers: MTP tensors inside the file


def read_gguf_header(path: Path) -> GGUFHeader:
    """The few metadata fields that decide whether we can run a GGUF file."""
    return _read_header(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_header(path: str, _mtime: int) -> GGUFHeader:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as error:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({error})") from None

    def scalar(key):
        value = reader.fields.get(key)
        return value.contents() if value is not None else None

    arch = scalar("general.architecture") or "?"
    file_type = scalar("general.file_type")
    try:
        file_type = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        file_type = str(file_type)
    return GGUFHeader(arch, file_type, int(scalar(f"{arch}.nextn_predict_layers") or 0))


def gguf_problem(header: GGUFHeader) -> str | None:
    """Why our GGUF import cannot read a file with this header, or None if it can."""
    from mlx_spec.models.gguf_import import ARCHITECTURES

    if header.architecture in ARCHITECTURES:
        return None
    return (f"a GGUF of architecture '{header.architecture}', which mlx-spec cannot import "
            f"(it imports {', '.join(sorted(ARCHITECTURES))})")


# ---------------------------------------------------------------------------------------
# Ollama
# ---------------------------------------------------------------------------------------


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
        return OLLAMA_PREFIX + self.name

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
    rest, tag = name, _OLLAMA_TAG
    if rest.rfind(":") > rest.rfind("/"):
        rest, tag = rest.rsplit(":", 1)
    parts = rest.split("/")
    if not rest or len(parts) > 3 or not all(parts) or not tag or any(p in (".", "..") for p in parts + [tag]):
        raise ModelLoadError(f"'{OLLAMA_PREFIX}{name}' is not an Ollama model name (NAME[:TAG], "
                             "e.g. ollama:gemma4:12b)")
    parts = [_OLLAMA_HOST, _OLLAMA_NAMESPACE][: 3 - len(parts)] + parts
    return parts[0], parts[1], parts[2], tag


def find_ollama(name: str) -> OllamaModel:
    """The model `name` (NAME[:TAG]) in the first Ollama store that has it.

    Raises:
        ModelLoadError: no store has it, or its manifest is damaged.
    """
    host, namespace, model, tag = parse_ollama_name(name)
    roots = ollama_roots()
    for root in roots:
        manifest = _manifest_path(root / "manifests", host, namespace, model, tag)
        if manifest is not None:
            return read_ollama_manifest(manifest, root, name)
    where = " or ".join(str(r) for r in roots)
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


def list_ollama() -> list[OllamaModel]:
    """Every model in every Ollama store (manifests/HOST/NAMESPACE/MODEL/TAG), named as
    Ollama shows them (host and namespace left out when they are the defaults)."""
    found, seen = [], set()
    for root in ollama_roots():
        manifests = root / "manifests"
        for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else ():
            if not manifest.is_file():
                continue
            host, namespace, model, tag = manifest.relative_to(manifests).parts
            name = f"{model}:{tag}"
            if namespace != _OLLAMA_NAMESPACE or host != _OLLAMA_HOST:
                name = f"{namespace}/{name}" if host == _OLLAMA_HOST else f"{host}/{namespace}/{name}"
            if name in seen:
                continue
            seen.add(name)
            try:
                found.append(read_ollama_manifest(manifest, root, name))
            except ModelLoadError:
                continue
    return found


# ---------------------------------------------------------------------------------------
# LM Studio
# ---------------------------------------------------------------------------------------


@dataclass
class LMStudioModel:
    """One model in LM Studio's folder: an MLX folder (`folder`) or a GGUF file (`gguf`)."""

    name: str  # PUBLISHER/MODEL[/FILE.gguf]
    folder: Path
    gguf: Path | None
    size: int

    @property
    def source(self) -> str:
        return LMSTUDIO_PREFIX + self.name


def find_lmstudio(name: str) -> LMStudioModel:
    """LM Studio's PUBLISHER/MODEL (an MLX folder or one GGUF file), or PUBLISHER/MODEL/FILE.gguf.

    Raises:
        ModelLoadError: not found, several GGUF files and none named, or neither format.
    """
    parts = name.strip("/").split("/")
    if len(parts) not in (2, 3) or any(p in ("", ".", "..") for p in parts):
        raise ModelLoadError(f"'{LMSTUDIO_PREFIX}{name}' is not an LM Studio model name "
                             "(PUBLISHER/MODEL, e.g. lmstudio:lmstudio-community/gemma-3-270m-it-GGUF)")
    roots = lmstudio_roots()
    for root in roots:
        folder = root / parts[0] / parts[1]
        if not folder.is_dir():
            continue
        if len(parts) == 3:
            file = folder / parts[2]
            if not file.is_file():
                raise ModelLoadError(f"LM Studio's {folder} has no file {parts[2]}")
            return LMStudioModel(name, folder, file, file.stat().st_size)
        if _is_mlx_folder(folder):
            return LMStudioModel(name, folder, None, _folder_size(folder))
        ggufs = _model_ggufs(folder)
        if len(ggufs) == 1:
            return LMStudioModel(name, folder, ggufs[0], ggufs[0].stat().st_size)
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise ModelLoadError(f"LM Studio's {name} holds several GGUF files ({names}); name one: "
                                 f"{LMSTUDIO_PREFIX}{name}/{ggufs[0].name}")
        raise ModelLoadError(f"LM Studio's {folder} holds neither an MLX model (config.json and "
                             "*.safetensors) nor a GGUF file")
    where = " or ".join(str(r) for r in roots)
    raise ModelLoadError(f"LM Studio has no model '{name}' in {where} (set LMSTUDIO_MODELS to its "
                         "models folder if you moved it)")


def list_lmstudio() -> list[LMStudioModel]:
    """Every MLX folder and GGUF file under PUBLISHER/MODEL in LM Studio's folders."""
    found = []
    for root in lmstudio_roots():
        for folder in sorted(root.glob("*/*")) if root.is_dir() else ():
            if not folder.is_dir():
                continue
            name = f"{folder.parent.name}/{folder.name}"
            if _is_mlx_folder(folder):
                found.append(LMStudioModel(name, folder, None, _folder_size(folder)))
                continue
            ggufs = _model_ggufs(folder)
            for gguf_file in ggufs:
                label = name if len(ggufs) == 1 else f"{name}/{gguf_file.name}"
                found.append(LMStudioModel(label, folder, gguf_file, gguf_file.stat().st_size))
    return found


def _is_mlx_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _model_ggufs(folder: Path) -> list[Path]:
    # Vision models ship their image projector as mmproj-*.gguf beside the language model.
    return sorted(p for p in folder.glob("*.gguf") if not p.name.lower().startswith("mmproj"))


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


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
        wants_draft = name.endswith(DRAFT_SUFFIX)
        model = find_ollama(name.removesuffix(DRAFT_SUFFIX))
        if wants_draft:
            problem = model.draft_problem() or (None if model.draft else "its manifest has no draft layer")
            if problem:
                raise ModelLoadError(f"{source}: {problem}")
            return StoreFile(model.draft, True, model.draft_digest)
        problem = model.problem()
        if problem:
            raise ModelLoadError(f"{source}: {problem}")
        return StoreFile(model.model, True, model.model_digest)
    model = find_lmstudio(source[len(LMSTUDIO_PREFIX):])
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
    if not source.startswith(OLLAMA_PREFIX) or source.endswith(DRAFT_SUFFIX):
        return StoreDefaults(None, None)
    model = find_ollama(source[len(OLLAMA_PREFIX):])
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
    gamma = OLLAMA_DEFAULT_DRAFT_TOKENS if model.draft_num_predict is None else model.draft_num_predict
    return StoreDefaults(model.source + DRAFT_SUFFIX, gamma)


# ---------------------------------------------------------------------------------------
# `models list --local`
# ---------------------------------------------------------------------------------------


@dataclass
class LocalModel:
    """A model on disk that mlx-spec can run (`problem` None) or cannot (why)."""

    source: str  # what to pass to -m
    store: str  # "hf" | "ollama" | "lmstudio"
    format: str  # e.g. "MLX gemma3_text", "GGUF gemma3 Q4_K_M"
    size: int  # bytes on disk (target and its draft together for Ollama)
    draft: str | None = None  # the model file's own draft, e.g. "GGUF gemma3, γ 3"
    draft_size: int = 0
    problem: str | None = None


def list_local() -> list[LocalModel]:
    """What the HF cache, Ollama's store and LM Studio's folder hold, each marked with
    whether mlx-spec can run it. Reads only small files and GGUF headers."""
    from mlx_spec.models import hub

    found = []
    for repo_id, folder, size in hub.cached_models():
        ggufs = _model_ggufs(folder)
        if ggufs and not any(folder.glob("*.safetensors")):  # a GGUF repo: -m takes each file's path
            found.extend(_gguf_entry(str(p), "hf", p, p.stat().st_size) for p in ggufs)
        else:
            found.append(_folder_entry(repo_id, "hf", folder, size))
    for model in list_ollama():
        found.append(_ollama_entry(model))
    for model in list_lmstudio():
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

    from mlx_spec.models.gemma4_assistant import is_assistant_config

    if is_assistant_config(config):
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


def _ollama_entry(model: OllamaModel) -> LocalModel:
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
            gamma = OLLAMA_DEFAULT_DRAFT_TOKENS if model.draft_num_predict is None else model.draft_num_predict
            entry.draft = f"GGUF {header.architecture}, γ {gamma}"
        entry.draft_size = model.sizes.get("draft", 0)
    return entry
