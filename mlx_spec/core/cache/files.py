"""Prompt caches in files: a conversation's caches outlive the process.

A file holds a `PromptCache` (the target's `SequenceCache` and the draft model's, if any):
each layer's class name and its state by mlx-lm's cache protocol (`state` / `from_state`,
scalars kept in the metadata), and the token ids each cache holds. It is safetensors, as
mlx-lm's `save_prompt_cache` writes, so `mx.load` reads it.

A file is valid only for what made it, so it carries a key (`cache_key`): the weights' and
tokenizer's fingerprints, dtype, kv-bits, windows and rollback slack. Reading opens regular
files only (never blocking on a FIFO or a device), checks the key, one digest over the
metadata (classes, scalars, vocab, key) and every array's bytes, that the layers are the ones
this model makes, and every restored scalar against the arrays and the model (positions
against K/V shapes, windows, quantization); anything else raises `CacheFileError` (one
line), so a damaged, truncated, edited, foreign or mismatched file never feeds the model a
wrong state. The draft's part has a key of its own: a draft that
changed loses only that part (it is prefilled again; output never depends on it).

Writes are atomic (a temp file with a unique name in the same folder, fsync, `os.replace`),
so readers, and other processes writing the same folder, see a whole file or none. A failed
write (a full disk) raises `OSError` and leaves no file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import struct
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as theirs

from mlx_spec.core.cache.layer_base import buffer_parts
from mlx_spec.core.cache.global_layers import ChannelQuantizedKVCache
from mlx_spec.core.cache.layers import LAYER_CLASSES, make_cache
from mlx_spec.core.cache.sequence import PromptCache, SequenceCache
from mlx_spec.core.cache.window_layers import WindowKVCache
from mlx_spec.errors import UsageError

FORMAT = "mlx-spec/prompt-cache/2"  # 2: the digest covers the metadata too
# How quantized K/V were computed: each position's precision by its position alone
# (`SequenceCache`), not by where a prefill chunk ended.
KV_PRECISION = "by-position"
SAMPLES = 64  # elements per weight array in a fingerprint

_CODES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
          mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.uint8: "U8",
          mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.bool_: "BOOL"}


class CacheFileError(Exception):
    """A cache file that cannot be used; the message is one line."""


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0][:200]


# -- keys ------------------------------------------------------------------------------

def model_fingerprint(model) -> str:
    """A hash of every weight array's name, shape, dtype and `SAMPLES` elements spread
    evenly over it. Another checkpoint, a fine-tune, another dtype or quantization changes
    names, shapes, dtypes or values all over every array they touch, so samples catch them;
    reading all the weights would cost seconds on a 12B model, and file names or times say
    nothing about a model quantized on load or built in memory."""
    digest = hashlib.sha256()
    params = tree_flatten(model.parameters())
    samples = []
    for name, array in params:
        flat = array.reshape(-1)
        stride = max(1, flat.size // SAMPLES)
        samples.append(mx.contiguous(flat[::stride][:SAMPLES]))
    mx.eval(samples)
    for (name, array), sample in zip(params, samples):
        digest.update(f"{name}:{array.shape}:{array.dtype};".encode())
        digest.update(memoryview(sample))
    return digest.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary (every token's text and id)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]


def _dtype(model) -> str:
    floats = [a.dtype for _, a in tree_flatten(model.parameters()) if mx.issubdtype(a.dtype, mx.floating)]
    return str(floats[0]) if floats else "none"


def _windows(layers: list) -> list:
    return [layer.window if isinstance(layer, WindowKVCache) else None for layer in layers]


def model_key(model, slack: int, kv=None) -> dict:
    """What a model's cache file must match: weights, dtype, K/V quantization (`kv`, a
    `layers.KVQuantization` or None), windows, slack."""
    key = {"weights": model_fingerprint(model), "dtype": _dtype(model),
           "kv_bits": kv and kv.bits, "kv_group_size": kv and kv.group_size, "kv_start": kv and kv.start,
           "windows": _windows(make_cache(model, slack)), "slack": slack}
    if kv is not None:  # files from before a position's precision was its own hold other K/V
        key["kv_precision"] = KV_PRECISION
    return key


def cache_key(engine, tokenizer) -> dict:
    """The key of `engine`'s prompt caches: the target's `model_key` and the tokenizer's
    fingerprint; "draft" is the draft model's `model_key` (None without one)."""
    slack = engine.max_gamma + 1
    # only a drafter that keeps a cache of its own model has a draft cache to key
    draft = engine.drafter.model if engine.drafter is not None and engine.drafter.own_cache else None
    return {"format": FORMAT, "tokenizer": tokenizer_fingerprint(tokenizer),
            "target": model_key(engine.target, slack, engine.kv),
            "draft": model_key(draft, slack, engine.draft_kv) if draft is not None else None}


def key_id(key: dict) -> str:
    """A short name for what the target part of a file must match."""
    main = {k: v for k, v in key.items() if k != "draft"}
    return hashlib.sha256(json.dumps(main, sort_keys=True).encode()).hexdigest()[:16]


def _mismatch(found: dict, wanted: dict) -> Optional[str]:
    """What differs between two keys (None: nothing), in words."""
    if found.get("format") != wanted.get("format"):
        return f"it is not an mlx-spec prompt cache of this version ({FORMAT})"
    if found.get("tokenizer") != wanted["tokenizer"]:
        return "it was made with another tokenizer"
    # the specific differences first: another dtype changes the weights' fingerprint too
    for field, words in (("dtype", "another dtype"), ("kv_bits", "other --kv-bits"),
                         ("kv_group_size", "another --kv-group-size"), ("kv_start", "another --kv-start"),
                         ("kv_precision", "an older rule for quantized K/V"), ("windows", "other sliding windows"),
                         ("slack", "another rollback slack (max γ + 1)"), ("weights", "another model")):
        have, want = found.get("target", {}).get(field), wanted["target"].get(field)
        if have != want:
            detail = f" ({have}; here {want})" if field not in ("weights", "windows") else ""
            return f"it was made with {words}{detail}"
    return None


def writable_folder(folder, flag: str) -> Path:
    """`folder`, created if missing; a one-line `UsageError` naming `flag` if it cannot
    hold files."""
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{flag} {folder}: cannot create it ({error.strerror or error})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {folder}: not a writable folder")
    return path


# -- safetensors, atomically -----------------------------------------------------------

def _bytes(array: mx.array) -> memoryview:
    array = mx.contiguous(array)
    mx.eval(array)
    return memoryview(array)


def content_digest(arrays: dict, metadata: str = "") -> str:
    """sha256 of `metadata` (text) and of every array's name, shape, dtype and bytes."""
    digest = hashlib.sha256(f"{len(metadata)}:{metadata};".encode())
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(f"{name}:{array.shape}:{array.dtype};".encode())
        digest.update(_bytes(array))
    return digest.hexdigest()


def write_safetensors(path: Path, arrays: dict, metadata: dict) -> int:
    """Write a safetensors file atomically: a temp file beside `path`, fsync'd, then
    renamed over it. Raises OSError (leaving no file, old or new, half written) when the
    write fails. Returns the bytes written."""
    path = Path(path)
    arrays = {name: mx.contiguous(a) for name, a in arrays.items()}
    mx.eval(list(arrays.values()))
    header, offset = {}, 0
    for name, array in arrays.items():
        if array.dtype not in _CODES:
            raise ValueError(f"cannot store {array.dtype} arrays")
        header[name] = {"dtype": _CODES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header["__metadata__"] = metadata
    text = json.dumps(header, ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned

    def write(out) -> None:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for array in arrays.values():
            out.write(memoryview(array))

    _write_atomically(path, write)
    return 8 + len(text) + offset


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically (see `write_safetensors`)."""
    _write_atomically(Path(path), lambda out: out.write(text.encode()))


def _write_atomically(path: Path, write) -> None:
    # A unique temp name: processes writing the same folder never share one.
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a folder
        pass
    finally:
        os.close(fd)


def read_safetensors(path: Path) -> tuple[dict, dict]:
    """(arrays, metadata) of a safetensors file; CacheFileError if it cannot be read or is
    not a regular file. It is opened without blocking and checked on the open descriptor:
    `mx.load` on a FIFO would block holding the GIL, freezing the whole process."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CacheFileError(f"no such file: {path}") from None
    except OSError as error:
        raise CacheFileError(f"{path} cannot be opened ({error.strerror or error})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CacheFileError(f"{path} is not a regular file")
    try:
        with os.fdopen(fd, "rb") as file:
            arrays, metadata = mx.load(file, format="safetensors", return_metadata=True)
    except Exception as error:  # mx.load's RuntimeError / ValueError for damaged files
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CacheFileError(f"{path} is not a readable safetensors file ({first})") from None
    if not isinstance(arrays, dict):
        raise CacheFileError(f"{path} is not a safetensors file")
    return arrays, metadata


# -- caches <-> arrays -----------------------------------------------------------------

def _layer_state(layer) -> tuple:
    state = layer.state
    if isinstance(layer, theirs.KVCache) and layer.keys is not None:
        # mlx-lm's KVCache state is its whole buffer; only `offset` positions are used
        state = (layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :], layer.offset)
    return tuple(state)


def sequence_arrays(seq: SequenceCache, prefix: str, arrays: dict) -> dict:
    """Put `seq`'s layers' arrays into `arrays` (named prefix.layer.item) and return the
    rest of its state (classes, scalars, ids) as JSON-able data."""
    layers = []
    for i, layer in enumerate(seq.cache):
        items = []
        for j, value in enumerate(_layer_state(layer)):
            if isinstance(value, mx.array):
                arrays[f"{prefix}.{i}.{j}"] = value
                items.append("@")
            elif isinstance(value, (tuple, list)) and value and all(isinstance(v, mx.array) for v in value):
                for k, part in enumerate(value):  # a quantized K or V: (packed, scales, biases)
                    arrays[f"{prefix}.{i}.{j}.{k}"] = part
                items.append({"parts": len(value)})
            elif value is None or isinstance(value, (int, float, str)):
                items.append({"v": value})
            else:
                raise CacheFileError(f"a {type(layer).__name__} layer cannot be saved")
        meta = getattr(layer, "meta_state", None)  # mlx-lm's older protocol
        layers.append({"class": type(layer).__name__, "state": items,
                       "meta": list(meta) if isinstance(meta, (tuple, list)) and meta else None})
    arrays[f"{prefix}.ids"] = mx.array(seq.ids, mx.int32) if seq.ids else mx.zeros((0,), mx.int32)
    return {"layers": layers, "vocab": seq.vocab}


def _cache_class(name: str):
    cls = LAYER_CLASSES.get(name) or getattr(theirs, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_state"):
        raise CacheFileError(f"it holds a cache layer of unknown type {name!r}")
    return cls


def restore_sequence(model, slack: int, arrays: dict, prefix: str, info: dict, kv=None) -> SequenceCache:
    """A `SequenceCache` of `model` (K/V quantized as `kv`) from what `sequence_arrays`
    stored; CacheFileError if its layers are not the ones `model` makes."""
    vocab = info.get("vocab")
    if vocab is not None and not (type(vocab) is int and vocab > 0):
        raise CacheFileError(f"its vocab {vocab!r} is not a positive integer")
    seq = SequenceCache(model, slack, vocab, kv=kv)
    fresh, stored = seq.cache, info["layers"]
    if len(stored) != len(fresh):
        raise CacheFileError(f"it holds {len(stored)} cache layers, the model makes {len(fresh)}")
    ids = arrays.get(f"{prefix}.ids")
    if ids is None:
        raise CacheFileError("it holds no token ids")
    seq.ids = [int(t) for t in ids.tolist()]
    layers = []
    for i, (entry, made) in enumerate(zip(stored, fresh)):
        # a quantized cache (--kv-bits, past --kv-start) holds each layer's quantized twin
        made_names = {type(made).__name__} | ({type(made.to_quantized()).__name__}
                                              if kv is not None and hasattr(made, "to_quantized") else set())
        if entry["class"] not in made_names:
            raise CacheFileError(f"layer {i} is a {entry['class']}, the model makes a {type(made).__name__}")
        try:
            state = tuple(arrays[f"{prefix}.{i}.{j}"] if item == "@" else
                          tuple(arrays[f"{prefix}.{i}.{j}.{k}"] for k in range(item["parts"])) if "parts" in item
                          else item["v"]
                          for j, item in enumerate(entry["state"]))
        except KeyError as missing:
            raise CacheFileError(f"array {missing} is missing") from None
        cls = _cache_class(entry["class"])
        layer = cls.from_state(state, entry["meta"]) if entry.get("meta") else cls.from_state(state)
        if getattr(layer, "window", None) != getattr(made, "window", None):
            raise CacheFileError(f"layer {i} has window {layer.window}, the model's is {made.window}")
        if hasattr(layer, "slack"):
            layer.slack = slack
        offset = getattr(layer, "offset", len(seq.ids))
        if offset != len(seq.ids):
            raise CacheFileError(f"layer {i} holds {offset} positions but the file {len(seq.ids)} ids")
        _check_layer(i, layer, kv)
        layers.append(layer)
    seq.cache = layers
    return seq


def _slots(buffer) -> int:
    return buffer_parts(buffer)[0].shape[2]


def _check_layer(i: int, layer, kv) -> None:
    """CacheFileError unless `layer`'s restored scalars agree with its arrays and the model:
    the positions its K and V hold (a window's start, a channel-quantized layer's groups),
    and the quantization (`kv`). Arrays of the wrong rank or shape raise IndexError or
    ValueError here, which `load_prompt_cache` reports as damage too."""
    offset = layer.offset
    if isinstance(layer, ChannelQuantizedKVCache):
        if layer.values is None:
            holds = offset == 0
        else:
            groups = buffer_parts(layer.keys_t)[1].shape[-1]
            holds = (0 <= layer.quantized <= offset and layer.quantized % layer.group_size == 0
                     and groups * layer.group_size == layer.quantized and _slots(layer.values) == offset
                     and layer.tail.shape[2] == offset - layer.quantized)
    elif hasattr(layer, "keys") and hasattr(layer, "values"):  # a window's, or mlx-lm's KVCache
        start = getattr(layer, "start", 0)
        if layer.keys is None or layer.values is None:
            holds = layer.keys is layer.values and offset == start == 0
        else:
            holds = 0 <= start <= offset and _slots(layer.keys) == _slots(layer.values) == offset - start
    else:
        holds = True  # a class of mlx-lm's we do not make: its own `from_state` checks
    if not holds:
        raise CacheFileError(f"layer {i}'s positions do not match its arrays")
    if hasattr(layer, "bits") and (kv is None or (layer.bits, layer.group_size) != (kv.bits, kv.group_size)):
        raise CacheFileError(f"layer {i} is quantized to {layer.bits} bits in groups of {layer.group_size}, "
                             f"not as this model's cache")


# -- whole prompt caches ---------------------------------------------------------------

def save_prompt_cache(path: Path, cache: PromptCache, key: dict, extra: Optional[dict] = None) -> int:
    """Write both models' caches and `extra` (JSON-able, e.g. a chat's messages) to `path`
    atomically. Returns the bytes written; raises OSError when the write fails."""
    arrays: dict = {}
    info = {"key": key, "target": sequence_arrays(cache.target, "target", arrays),
            "draft": None, "extra": extra}
    if cache.draft is not None and cache.draft.ids and key.get("draft") is not None:
        info["draft"] = sequence_arrays(cache.draft, "draft", arrays)
    text = json.dumps(info)
    metadata = {"format": FORMAT, "mlx_spec": text, "digest": content_digest(arrays, text)}
    return write_safetensors(path, arrays, metadata)


def load_prompt_cache(path: Path, engine, key: dict) -> tuple[PromptCache, Optional[dict]]:
    """The `PromptCache` saved at `path` for `engine` (whose key is `key`) and the file's
    `extra`. Raises CacheFileError, with one line saying why, for a file that is damaged,
    truncated, foreign or made with another model, tokenizer, dtype, kv-bits or window."""
    arrays, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT or not isinstance(metadata.get("mlx_spec"), str):
        raise CacheFileError(f"{path} is not an mlx-spec prompt cache of this version ({FORMAT})")
    try:
        info = json.loads(metadata["mlx_spec"])
    except ValueError:
        raise CacheFileError(f"{path} is damaged (its metadata is not JSON)") from None
    if not isinstance(info, dict) or not isinstance(info.get("key") or {}, dict):
        raise CacheFileError(f"{path} is damaged (its metadata is not an object)")
    why = _mismatch(info.get("key") or {}, key)
    if why:
        raise CacheFileError(f"{path} does not fit this model: {why}")
    if metadata.get("digest") != content_digest(arrays, metadata["mlx_spec"]):
        raise CacheFileError(f"{path} is damaged (its metadata or arrays do not match their digest)")
    try:
        cache = engine.make_prompt_cache()
        vocab = cache.target.vocab  # the target's own cache feeds every id (None)
        cache.target = restore_sequence(engine.target, cache.slack, arrays, "target", info["target"], engine.kv)
        if cache.target.vocab != vocab:
            raise CacheFileError(f"its target vocab {cache.target.vocab} is not {vocab}")
        draft_model = None if engine.drafter is None else engine.drafter.model
        if info.get("draft") and key.get("draft") is not None and info["key"].get("draft") == key["draft"]:
            cache.draft = restore_sequence(draft_model, cache.slack, arrays, "draft", info["draft"],
                                           engine.draft_kv)
    except CacheFileError as error:
        raise CacheFileError(f"{path} does not fit this model: {error}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise CacheFileError(f"{path} is damaged ({type(error).__name__}: {_first_line(error)})") from None
    return cache, info.get("extra")
