"""Import a llama.cpp GGUF file as an mlx-lm model folder.

GGUF files (from Ollama, LM Studio, llama.cpp) hold block-quantized weights under llama.cpp
tensor names, with the tokenizer as metadata. We dequantize every tensor with the `gguf`
package (`mx.load` decodes Q4_K wrongly and rejects Q5_0), rename it to the mlx-lm parameter
it belongs to, build `tokenizer.json` from the metadata with transformers' GGUF tokenizer
conversion (no torch), and write the result once, atomically, under the cache directory keyed
by the file's sha256. Later loads read that folder with mlx-lm like any other checkpoint.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from mlx_spec.errors import ModelLoadError
from mlx_spec.models.chat_templates import GEMMA_CHAT_TEMPLATE
from mlx_spec.progress import StderrProgress, progress_mode

# Bump when the converted layout changes, so stale cache folders are not reused.
FORMAT_VERSION = 1

# Converted weights are stored in float16. Measured on the embedded Gemma 3 270M (Q4_K_M),
# perplexity of tests/data/english_paragraph.txt evaluated in float32 (bfloat16):
#   float32 storage 13.336 (13.354), 1072 MB;  float16 13.336 (13.347), 536 MB;
#   bfloat16 13.327 (13.354), 536 MB.  Load time 0.41 s / 0.21 s / 0.23 s.
# Dequantized GGUF values are (float16 scale) x (small integer), so float16 keeps them to
# rounding at half the disk of float32; a tensor beyond float16's range stays float32.
STORAGE_DTYPE = mx.float16

# Shard size for the converted safetensors: keeps peak memory bounded for large files.
_SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps onto an mlx-lm model.

    Attributes:
        config: GGUF metadata (and tensor shapes) -> mlx-lm config.json.
        norm_offset: subtracted from every RMSNorm weight; llama.cpp stores Gemma's
            `1 + w` while mlx-lm's Gemma RMSNorm multiplies by `1 + w` itself.
        norm_class: name of the mlx-lm module class whose weights get the offset.
        chat_template: fallback when the file carries none.
    """

    config: Callable[[dict, dict], dict]
    norm_offset: float
    norm_class: str
    chat_template: str | None


def _gemma3_config(meta: dict, shapes: dict) -> dict:
    def get(key, default=None):
        return meta.get(f"gemma3.{key}", default)

    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    head_dim = get("attention.key_length", hidden // heads)
    tokens = meta["tokenizer.ggml.tokens"]
    eos = [meta.get("tokenizer.ggml.eos_token_id", 1)]
    if "<end_of_turn>" in tokens:  # Gemma chat turns end with it (id 106)
        eos.append(tokens.index("<end_of_turn>"))
    config = dict(
        model_type="gemma3_text",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_round(get("attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=shapes["token_embd.weight"][0],
        rope_theta=_round(get("rope.freq_base", 1_000_000.0)),
        max_position_embeddings=get("context_length", 32768),
        sliding_window=get("attention.sliding_window", 512),
        # Not stored in GGUF; the same for every Gemma 3 size (HF configs).
        rope_local_base_freq=10_000.0,
        sliding_window_pattern=6,
        # Gemma 3 27B (62 layers) scales queries by hidden/heads = 168, every other size by
        # head_dim = 256; llama.cpp hard-codes the same rule.
        query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        eos_token_id=eos,
        tie_word_embeddings="output.weight" not in shapes,
    )
    if get("rope.scaling.type") == "linear":  # 4B and larger: global layers use factor 8
        config["rope_scaling"] = {"rope_type": "linear", "factor": _round(get("rope.scaling.factor"))}
    return config


ARCHITECTURES = {
    "gemma3": GGUFArchitecture(_gemma3_config, 1.0, "RMSNorm", GEMMA_CHAT_TEMPLATE),
}


def import_gguf(path: Path, cache_root: Path, *, sha256: str | None = None,
                progress: bool = True) -> Path:
    """Convert `path` into an mlx-lm folder under `cache_root/gguf`, or reuse the cached one.

    Args:
        path: the .gguf file.
        cache_root: mlx-spec's cache directory.
        sha256: the file's hash when already known (skips hashing it).
        progress: show a progress bar while converting.
    Returns:
        The folder holding config.json, model*.safetensors and the tokenizer.
    """
    sha256 = sha256 or file_sha256(path, cache_root)
    folder = converted_folder(cache_root, sha256)
    if (folder / "config.json").exists():
        return folder
    with cache_lock(cache_root, f"gguf-{sha256[:20]}", f"importing {path.name}", progress):
        if (folder / "config.json").exists():  # another process imported it while we waited
            return folder
        return _import_into(path, folder, sha256, progress)


def _import_into(path: Path, folder: Path, sha256: str, progress: bool) -> Path:
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
        _convert(path, tmp, progress)
        (tmp / "mlx_spec_source.json").write_text(json.dumps(
            {"file": path.name, "sha256": sha256, "format": FORMAT_VERSION,
             "dtype": str(STORAGE_DTYPE).removeprefix("mlx.core.")}, indent=2))
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
    the same: config.json, model*.safetensors, tokenizer.json, tokenizer_config.json)."""
    return (folder / "mlx_spec_source.json").is_file()


def converted_folder(cache_root: Path, sha256: str) -> Path:
    """Where the conversion of the GGUF file with this hash lives."""
    return cache_root / "gguf" / f"{sha256[:20]}-v{FORMAT_VERSION}"


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


def _convert(path: Path, out: Path, progress: bool) -> None:
    """Read, dequantize, rename and write one GGUF file into the empty folder `out`."""
    with StderrProgress(progress_mode(progress)) as display:
        bar = display.task(f"Importing {path.name}")
        bar.phase("reading GGUF header")
        reader = _open_reader(path)
        meta = _metadata(reader)
        arch_name = meta.get("general.architecture", "?")
        arch = ARCHITECTURES.get(arch_name)
        if arch is None:
            raise ModelLoadError(
                f"{path.name}: GGUF architecture '{arch_name}' is not supported "
                f"(mlx-spec imports: {', '.join(sorted(ARCHITECTURES))})")
        tensors = {t.name: t for t in reader.tensors}
        shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
        try:
            config = arch.config(meta, shapes)
        except (KeyError, TypeError, ValueError) as error:
            raise ModelLoadError(f"{path.name}: incomplete {arch_name} metadata ({error})") from None

        model = _skeleton(config)
        names = _gguf_names(arch_name, model, config["num_hidden_layers"])
        norms = _norm_parameters(model, arch.norm_class)
        bar.phase("dequantizing", total=len(names))
        shard, shard_bytes, shard_files = {}, 0, []
        for mlx_name, (gguf_name, shape) in names.items():
            shard[mlx_name] = _dequantize(path, tensors, shapes, gguf_name, shape,
                                          arch.norm_offset if mlx_name in norms else 0.0)
            shard_bytes += shard[mlx_name].nbytes
            if shard_bytes >= _SHARD_BYTES:
                shard_files.append(_write_shard(out, shard, len(shard_files)))
                shard, shard_bytes = {}, 0
            bar.advance()
        if shard or not shard_files:
            shard_files.append(_write_shard(out, shard, len(shard_files)))
        if len(shard_files) == 1:
            shard_files[0].rename(out / "model.safetensors")

        bar.phase("building tokenizer")
        _write_tokenizer(out, meta, arch_name, arch.chat_template)
        (out / "config.json").write_text(json.dumps(config, indent=2))


def _open_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, EOFError, UnicodeDecodeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ModelLoadError(f"{path.name} is truncated or not a GGUF file ({reason})") from None


def _metadata(reader) -> dict:
    """All scalar and array metadata as Python values."""
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except (ValueError, UnicodeDecodeError):  # undecodable optional fields: skip
            continue
    return meta


def _skeleton(config: dict):
    """The mlx-lm model for `config`, parameters unevaluated: only names and shapes are used."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if config.get("tie_word_embeddings") and hasattr(model, "sanitize"):
        model.sanitize({})  # no lm_head weight: the model ties it to the embedding
    return model


def _gguf_names(arch_name: str, model, n_layers: int) -> dict:
    """mlx-lm parameter name -> (GGUF tensor name, expected shape), via gguf's own name map."""
    import gguf
    from mlx.utils import tree_flatten

    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    name_map = gguf.get_tensor_name_map(arch_id, n_layers)
    names = {}
    for mlx_name, param in tree_flatten(model.parameters()):
        gguf_name = name_map.get_name(mlx_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelLoadError(f"no GGUF tensor name known for mlx-lm parameter {mlx_name}")
        names[mlx_name] = (gguf_name, tuple(param.shape))
    return names


def _norm_parameters(model, class_name: str) -> set[str]:
    return {f"{path}.weight" for path, module in model.named_modules()
            if type(module).__name__ == class_name}


def _dequantize(path, tensors, shapes, gguf_name, shape, offset) -> mx.array:
    import gguf
    import numpy as np  # here: a cached load imports this module but needs no numpy

    tensor = tensors.get(gguf_name)
    if tensor is None:
        raise ModelLoadError(f"{path.name} has no tensor {gguf_name}; the file is incomplete")
    if shapes[gguf_name] != shape:
        raise ModelLoadError(f"{path.name}: tensor {gguf_name} has shape {shapes[gguf_name]}, "
                             f"the model expects {shape}")
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(f"{path.name}: tensor {gguf_name} uses {tensor.tensor_type.name}, "
                             "which the gguf package cannot dequantize") from None
    except (ValueError, IndexError) as error:  # data shorter than its header says
        raise ModelLoadError(f"{path.name}: tensor {gguf_name} is damaged ({error})") from None
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    if offset:
        values = values - offset
    if not np.isfinite(values).all():
        raise ModelLoadError(f"{path.name}: tensor {gguf_name} holds NaN or infinite values")
    if STORAGE_DTYPE == mx.float16 and np.abs(values).max(initial=0.0) > 60_000:
        return mx.array(values)  # beyond float16's range (65504): keep this tensor in float32
    return mx.array(values).astype(STORAGE_DTYPE)


def _write_shard(out: Path, shard: dict, index: int) -> Path:
    file = out / f"model-{index + 1:05d}.safetensors"
    mx.save_safetensors(str(file), shard, metadata={"format": "mlx"})
    return file


def _write_tokenizer(out: Path, meta: dict, arch_name: str, fallback_template: str | None):
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

    bos = token("bos_token_id")
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", True):
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
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template") or fallback_template,
        "model_max_length": int(meta.get(f"{arch_name}.context_length", 32768)),
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}, indent=2))


def _remove_stale_temporaries(folder: Path, max_age_s: float = 6 * 3600) -> None:
    """Temporary folders of imports killed mid-way (old enough not to be running)."""
    now = time.time()
    for tmp in folder.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _round(value):
    """GGUF stores floats as f32; 9.999999974752427e-07 reads better as 1e-06."""
    return float(f"{float(value):.7g}") if value is not None else None
