"""Import a llama.cpp GGUF file as an mlx-lm model folder.

GGUF files (from Ollama, LM Studio, llama.cpp) hold block-quantized weights under llama.cpp
tensor names, with the tokenizer as metadata. We parse the header (`gguf_file`), read every tensor (`gguf_tensors`), rename it
to the mlx-lm parameter it belongs to (`gguf_architectures`), build `tokenizer.json` from the
metadata (`gguf_tokenizer`), and write the result once, atomically, under the cache directory
keyed by the file's sha256 and the storage. Later loads read that folder with mlx-lm like any
other checkpoint.

Storage: small files become float16 folders; large ones (a 12B) are re-quantized to MLX's
affine format tensor by tensor (`gguf_tensors.QUANT_BITS`), reading each tensor from the file
in row chunks and writing shards as they fill, so the whole float model is never in memory
and the folder is about the size of the GGUF.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading import gguf_architectures, gguf_tensors, gguf_tokenizer
from mlx_spec.loading.gguf_file import GGUFFile, read_gguf_file
from mlx_spec.progress import StderrProgress, progress_mode

# Bump when the converted layout changes, so stale cache folders are not reused. The float16
# layout is that of version 1 (unchanged: Gemma 3 imports stay valid); quantized folders have
# their own suffix, so a file imported both ways keeps both.
FORMAT_VERSION = 1
STORAGES = ("auto", "float16", "quantized")
_FOLDER_SUFFIX = {"float16": "", "quantized": "-mlxq"}
# "auto" quantizes files from this size on: a 1B Q4_K_M (~0.8 GB) stays float16 (~2 GB), a
# Gemma 4 E2B (~3 GB) or a 12B (~7 GB) is quantized.
QUANTIZE_FROM_BYTES = 1 << 30

# Shard size for the converted safetensors: what is held before it is written.
_SHARD_BYTES = 1 << 30


def import_gguf(path: Path, cache_root: Path, *, sha256: str | None = None,
                progress: bool = True, storage: str = "auto", label: str | None = None) -> Path:
    """Convert `path` into an mlx-lm folder under `cache_root/gguf`, or reuse the cached one.

    Args:
        path: the .gguf file.
        cache_root: mlx-spec's cache directory.
        sha256: the file's hash when already known (skips hashing it).
        progress: show a progress bar while converting.
        storage: "float16", "quantized" (MLX affine, bits per GGUF type:
            `gguf_tensors.QUANT_BITS`), or "auto": an import of the file made before in
            either storage (as `mlx-spec models import --storage` made it), else quantized
            for files of `QUANTIZE_FROM_BYTES` and more, float16 for smaller ones.
        label: what the progress line calls the file (default its name; a store's blob is
            named by its hash, so the store passes the model's name).
    Returns:
        The folder holding config.json, model*.safetensors and the tokenizer.
    """
    chosen = resolve_storage(path, storage)
    sha256 = sha256 or file_sha256(path, cache_root)
    if storage == "auto":
        made = [s for s in ("float16", "quantized")
                if (converted_folder(cache_root, sha256, s) / "config.json").exists()]
        chosen = chosen if chosen in made or not made else made[0]
    storage = chosen
    folder = converted_folder(cache_root, sha256, storage)
    if (folder / "config.json").exists():
        return folder
    label = label or path.name
    with cache_lock(cache_root, f"gguf-{sha256[:20]}", f"importing {label}", progress):
        if (folder / "config.json").exists():  # another process imported it while we waited
            return folder
        return _import_into(path, folder, sha256, progress, storage, label)


def resolve_storage(path: Path, storage: str = "auto") -> str:
    """"float16" or "quantized" for importing `path` with `storage` (see `import_gguf`)."""
    if storage not in STORAGES:
        raise ModelLoadError(f"unknown GGUF import storage '{storage}' (choose from {', '.join(STORAGES)})")
    if storage == "auto":
        try:
            size = path.stat().st_size
        except OSError:
            size = 0  # reported when the file is opened
        return "quantized" if size >= QUANTIZE_FROM_BYTES else "float16"
    return storage


def _import_into(path: Path, folder: Path, sha256: str, progress: bool, storage: str, label: str) -> Path:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(folder.parent)
        # Convert into a temporary sibling, then rename: an interrupted import leaves no
        # half-written folder where a later load would look.
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    except OSError as error:
        raise ModelLoadError(f"cannot write to the cache {folder.parent} ({error.strerror}); "
                             "set MLX_SPEC_CACHE to a writable folder") from None
    try:
        _convert(path, tmp, progress, storage, label)
        (tmp / "mlx_spec_source.json").write_text(json.dumps(
            {"file": path.name, "sha256": sha256, "format": FORMAT_VERSION, "storage": storage,
             "dtype": (str(gguf_tensors.STORAGE_DTYPE).removeprefix("mlx.core.") if storage == "float16"
                       else "quantized")},
            indent=2))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "config.json").exists():  # not a concurrent import that won
                raise
    except OSError as error:  # disk full while writing, most likely
        raise ModelLoadError(f"writing the converted model to {folder.parent} failed "
                             f"({error.strerror or error})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextmanager
def cache_lock(cache_root: Path, name: str, what: str, tell: bool = True) -> Iterator[None]:
    """Hold the exclusive lock `name` (a file under cache_root/locks) while the block runs,
    so concurrent first runs take turns instead of writing the same files (POSIX flock:
    released if the process dies). `what` the holder is doing, to tell a waiting user."""
    path = cache_root / "locks" / f"{name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError as error:
        raise ModelLoadError(f"cannot write to the cache {path.parent} ({error.strerror}); "
                             "set MLX_SPEC_CACHE to a writable folder") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if tell:
                print(f"waiting for another mlx-spec process that is {what}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_imported(folder: Path) -> bool:
    """Whether `folder` is one this module wrote (any format version; their layout is
    the same: config.json, model*.safetensors, tokenizer.json, tokenizer_config.json, and
    for a quantized import config.json's "quantization")."""
    return (folder / "mlx_spec_source.json").is_file()


def converted_folder(cache_root: Path, sha256: str, storage: str = "float16") -> Path:
    """Where the conversion of the GGUF file with this hash, in this storage, lives."""
    return cache_root / "gguf" / f"{sha256[:20]}-v{FORMAT_VERSION}{_FOLDER_SUFFIX[storage]}"


def file_sha256(path: Path, cache_root: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime) so big files are hashed once."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = cache_root / "gguf" / "hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    memo[key] = digest.hexdigest()
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, memo_path)
    except OSError:
        pass  # only a speed-up; import_gguf reports an unwritable cache itself
    return memo[key]


def _convert(path: Path, out: Path, progress: bool, storage: str = "float16", label: str | None = None) -> None:
    """Read, dequantize, rename, (re)quantize and write one GGUF file into the empty folder
    `out`, one tensor at a time: what is held at once is one shard (`_SHARD_BYTES`) and one
    chunk of float32 rows (`gguf_tensors._CHUNK_VALUES`)."""
    with StderrProgress(progress_mode(progress)) as display:
        bar = display.task(f"Importing {label or path.name}")
        bar.phase("reading GGUF header")
        reader = _open_reader(path)
        meta = reader.metadata
        arch_name = meta.get("general.architecture", "?")
        arch = gguf_architectures.ARCHITECTURES.get(arch_name)
        if arch is None:
            raise ModelLoadError(
                f"{path.name}: GGUF architecture '{arch_name}' is not supported "
                f"(mlx-spec imports: {', '.join(sorted(gguf_architectures.ARCHITECTURES))})")
        source = gguf_tensors.TensorSource(path, reader)
        try:
            config = arch.config(meta, source.shapes, source.read)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ModelLoadError(f"{path.name}: unsupported or incomplete {arch_name} "
                                 f"metadata ({error})") from None

        model = gguf_architectures.skeleton(config)
        n_layers = (config.get("text_config") or config)["num_hidden_layers"]
        names = gguf_architectures.gguf_names(arch, model, n_layers, source.shapes)
        norms = gguf_architectures.norm_parameters(model, arch.norm_class)
        quantizable = gguf_tensors.quantizable_modules(model) if storage == "quantized" else {}
        quantized = {}  # module path -> {"group_size", "bits"}
        weights_at = Counter()  # (bits, group size) -> weights quantized so
        bar.phase("dequantizing" if storage == "float16" else "quantizing", total=len(names))
        shard, shard_bytes, shard_files = {}, 0, []
        for mlx_name, (gguf_name, shape) in names.items():
            module = mlx_name.removesuffix(".weight")
            bits, group_size = source.quantization(gguf_name, shape) if module in quantizable else (None, None)
            offset = arch.norm_offset if mlx_name in norms else 0.0
            arrays = source.convert(gguf_name, shape, offset, bits)
            if bits:
                quantized[module] = {"group_size": group_size, "bits": bits}
                weights_at[(bits, group_size)] += math.prod(shape)
                arrays = dict(zip((f"{module}.weight", f"{module}.scales", f"{module}.biases"), arrays))
            else:
                arrays = {mlx_name: arrays[0]}
            shard.update(arrays)
            shard_bytes += sum(a.nbytes for a in arrays.values())
            if shard_bytes >= _SHARD_BYTES:
                shard_files.append(_write_shard(out, shard, len(shard_files)))
                shard, shard_bytes = {}, 0
            bar.advance()
        if shard or not shard_files:
            shard_files.append(_write_shard(out, shard, len(shard_files)))
        if len(shard_files) == 1:
            shard_files[0].rename(out / "model.safetensors")
        if quantized:
            # Every quantized layer is listed; the top-level pair (what `models info` shows)
            # is the one that holds the most weights.
            bits, group_size = weights_at.most_common(1)[0][0]
            common = {"group_size": group_size, "bits": bits, "mode": "affine"}
            config["quantization"] = config["quantization_config"] = {**common, **quantized}

        bar.phase("building tokenizer")
        gguf_tokenizer.write_tokenizer(out, meta, arch_name, arch.chat_template)
        (out / "config.json").write_text(json.dumps(config, indent=2))


def _open_reader(path: Path) -> GGUFFile:
    try:
        return read_gguf_file(path)
    except (ValueError, KeyError, IndexError, OSError, EOFError, UnicodeDecodeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelLoadError(f"{path.name} is truncated or not a GGUF file ({reason})") from None


def _write_shard(out: Path, shard: dict, index: int) -> Path:
    file = out / f"model-{index + 1:05d}.safetensors"
    mx.save_safetensors(str(file), shard, metadata={"format": "mlx"})
    shard.clear()
    mx.clear_cache()  # hand the written arrays' memory back before the next shard
    return file


def _remove_stale_temporaries(folder: Path, max_age_s: float = 6 * 3600) -> None:
    """Temporary folders of imports killed mid-way (old enough not to be running)."""
    now = time.time()
    for tmp in folder.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass
