"""Import a llama.cpp GGUF file as an mlx-lm model folder.

GGUF files (from Ollama, LM Studio, llama.cpp) hold block-quantized weights under llama.cpp
tensor names, with the tokenizer as metadata. We dequantize every tensor with the `gguf`
package (`mx.load` decodes Q4_K wrongly and rejects Q5_0), rename it to the mlx-lm parameter
it belongs to, build `tokenizer.json` from the metadata with transformers' GGUF tokenizer
conversion (no torch), and write the result once, atomically, under the cache directory keyed
by the file's sha256 and the storage. Later loads read that folder with mlx-lm like any other
checkpoint.

Storage: small files become float16 folders; large ones (a 12B) are re-quantized to MLX's
affine format tensor by tensor (`QUANT_BITS`), reading each tensor from the file in row
chunks and writing shards as they fill, so the whole float model is never in memory and the
folder is about the size of the GGUF.

Architectures: Gemma 3, Gemma 4 (`gemma4`: sliding/full layer pattern, K = V full layers,
KV-shared layers, per-layer inputs) and Gemma 4's MTP assistant (`gemma4-assistant`), as
llama.cpp's `convert_hf_to_gguf.py` writes them.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from mlx_spec.errors import ModelLoadError
from mlx_spec.models.chat_templates import GEMMA4_CHAT_TEMPLATE, GEMMA_CHAT_TEMPLATE
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

# Converted weights are stored in float16. Measured on the embedded Gemma 3 270M (Q4_K_M),
# perplexity of tests/data/english_paragraph.txt evaluated in float32 (bfloat16):
#   float32 storage 13.336 (13.354), 1072 MB;  float16 13.336 (13.347), 536 MB;
#   bfloat16 13.327 (13.354), 536 MB.  Load time 0.41 s / 0.21 s / 0.23 s.
# Dequantized GGUF values are (float16 scale) x (small integer), so float16 keeps them to
# rounding at half the disk of float32; a tensor beyond float16's range stays float32.
STORAGE_DTYPE = mx.float16

# GGUF tensor type -> MLX bits in a quantized import (affine). Q4_0, Q4_1, Q4_K, Q5_0, Q5_1 and
# Q8_0 blocks are affine over 32 values already (x = scale·q + bias), so they are re-encoded
# exactly, at group size 32 (`_exact_affine`); every other type is dequantized and quantized
# by MLX at QUANT_GROUP_SIZE. Q5_x take 8 bits, not 4: on the embedded 270M (most of whose
# matrices are Q5_0) perplexity is 0.2 % above the float16 import's at 8 bits, 8 % at 4, for
# a folder of 289 MB against 254 (the GGUF: 253; bench/gguf_import.py ->
# bench/results/gguf_import_gemma270m.json). Float tensors of a large file take 8 bits.
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8,
              "Q2_K": 4, "Q3_K": 4, "IQ4_NL": 4, "IQ4_XS": 4,
              "Q6_K": 8, "Q8_0": 8, "F16": 8, "BF16": 8, "F32": 8}
QUANT_GROUP_SIZE = 64
EXACT_GROUP_SIZE = 32

# Shard size for the converted safetensors: what is held before it is written.
_SHARD_BYTES = 1 << 30
# Rows are dequantized this many float32 values at a time (the gguf package's temporaries
# are a few times as large): a 262k-token embedding is 1B values, 4 GB as float32.
_CHUNK_VALUES = 8 << 20


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps onto an mlx-lm model.

    Attributes:
        config: (GGUF metadata, tensor shapes, tensor reader) -> mlx-lm config.json.
        norm_offset: subtracted from every RMSNorm weight; llama.cpp stores Gemma 3's
            `1 + w` while mlx-lm's Gemma 3 RMSNorm multiplies by `1 + w` itself (Gemma 4
            norms multiply by the plain weight: 0).
        norm_class: name of the mlx-lm module class whose weights get the offset.
        chat_template: fallback when the file carries none.
        names: the gguf package's architecture whose tensor-name map applies.
        extra_names: mlx parameter -> GGUF tensor, for tensors that map lacks.
    """

    config: Callable[[dict, dict, Callable], dict]
    norm_offset: float
    norm_class: str
    chat_template: str | None
    names: str
    extra_names: dict = field(default_factory=dict)


def _gemma3_config(meta: dict, shapes: dict, read) -> dict:
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


def _gemma4_text_config(meta: dict, shapes: dict, read, prefix: str) -> dict:
    """The `gemma4_text` fields llama.cpp's converter keeps (conversion/gemma.py, Gemma4Model)."""
    def get(key, default=None):
        return meta.get(f"{prefix}.{key}", default)

    if any(".ffn_gate_inp." in name for name in shapes):
        raise ValueError("mixture-of-experts layers (26B-A4B) are not supported yet")
    layers = get("block_count")
    sliding = get("attention.sliding_window_pattern")
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    first_shared = layers - get("attention.shared_kv_layers", 0)
    # Per-layer lists where sliding and full layers differ; a scalar where they do not.
    kv_heads = get("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    feed_forward = get("feed_forward_length")
    feed_forward = feed_forward if isinstance(feed_forward, list) else [feed_forward] * layers
    intermediate = feed_forward[0]
    double_wide = [intermediate * (2 if i >= first_shared else 1) for i in range(layers)]
    if feed_forward not in ([intermediate] * layers, double_wide):
        raise ValueError(f"per-layer feed-forward sizes {feed_forward} are not supported")
    full = layer_types.index("full_attention")
    head_dim, global_head_dim = get("attention.key_length_swa"), get("attention.key_length")
    # The full layers' partial RoPE is written as frequency factors: 1 for each rotated
    # pair, 1e30 (no rotation) for the rest.
    factors = read("rope_freqs.weight") if "rope_freqs.weight" in shapes else None
    rotated = int((factors < 1e10).sum()) if factors is not None else global_head_dim // 2
    per_layer = get("embedding_length_per_layer_input", 0)
    return dict(
        model_type="gemma4_text",
        hidden_size=get("embedding_length"),
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        use_double_wide_mlp=feed_forward != [intermediate] * layers,
        num_attention_heads=get("attention.head_count"),
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_key_value_heads=kv_heads[layer_types.index("sliding_attention")],
        num_global_key_value_heads=kv_heads[full],
        # K = V: a full layer that has keys but no value projection uses its keys as values
        attention_k_eq_v=(f"blk.{full}.attn_k.weight" in shapes
                          and f"blk.{full}.attn_v.weight" not in shapes),
        num_kv_shared_layers=layers - first_shared,
        hidden_size_per_layer_input=per_layer,
        vocab_size=shapes["token_embd.weight"][0],
        vocab_size_per_layer_input=shapes["per_layer_token_embd.weight"][0] if per_layer else 0,
        rms_norm_eps=_round(get("attention.layer_norm_rms_epsilon", 1e-6)),
        sliding_window=get("attention.sliding_window"),
        layer_types=layer_types,
        max_position_embeddings=get("context_length", 131072),
        final_logit_softcapping=_round(get("final_logit_softcapping")),
        enable_moe_block=False,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "full_attention": {"partial_rotary_factor": _round(rotated / (global_head_dim // 2)),
                               "rope_theta": _round(get("rope.freq_base", 1_000_000.0)),
                               "rope_type": "proportional"},
            "sliding_attention": {"partial_rotary_factor": _round(get("rope.dimension_count_swa", head_dim)
                                                                  / head_dim),
                                  "rope_theta": _round(get("rope.freq_base_swa", 10_000.0)),
                                  "rope_type": "default"},
        },
        tie_word_embeddings="output.weight" not in shapes,
    )


def _gemma4_config(meta: dict, shapes: dict, read) -> dict:
    config = _gemma4_text_config(meta, shapes, read, "gemma4")
    config["eos_token_id"] = [meta.get("tokenizer.ggml.eos_token_id", 1)]  # + <turn|>: loader
    return config


def _gemma4_assistant_config(meta: dict, shapes: dict, read) -> dict:
    """The assistant's config in the released checkpoints' schema (gemma4_assistant). The
    converter drops the centroid head of E2B/E4B assistants, so their GGUFs draft with the
    dense tied head, as llama.cpp does; a file that has the centroids keeps them."""
    text = _gemma4_text_config(meta, shapes, read, "gemma4-assistant")
    centroids = "masked_embd_centroids.weight" in shapes
    config = dict(
        model_type="gemma4_assistant" if centroids else "gemma4_unified_assistant",
        backbone_hidden_size=meta["gemma4-assistant.embedding_length_out"],
        use_ordered_embeddings=centroids,
        tie_word_embeddings=True,
        text_config=text,
    )
    if centroids:
        config["num_centroids"] = shapes["masked_embd_centroids.weight"][0]
    return config


ARCHITECTURES = {
    "gemma3": GGUFArchitecture(_gemma3_config, 1.0, "RMSNorm", GEMMA_CHAT_TEMPLATE, "gemma3"),
    "gemma4": GGUFArchitecture(_gemma4_config, 0.0, "RMSNorm", GEMMA4_CHAT_TEMPLATE, "gemma4"),
    "gemma4-assistant": GGUFArchitecture(
        _gemma4_assistant_config, 0.0, "RMSNorm", None, "gemma4",
        extra_names={"pre_projection.weight": "nextn.pre_projection.weight",
                     "post_projection.weight": "nextn.post_projection.weight",
                     "masked_embedding.centroids.weight": "masked_embd_centroids.weight",
                     "masked_embedding.token_ordering": "masked_embd_ordering"}),
}


def import_gguf(path: Path, cache_root: Path, *, sha256: str | None = None,
                progress: bool = True, storage: str = "auto", label: str | None = None) -> Path:
    """Convert `path` into an mlx-lm folder under `cache_root/gguf`, or reuse the cached one.

    Args:
        path: the .gguf file.
        cache_root: mlx-spec's cache directory.
        sha256: the file's hash when already known (skips hashing it).
        progress: show a progress bar while converting.
        storage: "float16", "quantized" (MLX affine, bits per GGUF type: `QUANT_BITS`), or
            "auto": an import of the file made before in either storage (as `mlx-spec models
            import --storage` made it), else quantized for files of `QUANTIZE_FROM_BYTES`
            and more, float16 for smaller ones.
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
             "dtype": str(STORAGE_DTYPE).removeprefix("mlx.core.") if storage == "float16" else "quantized"},
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
    chunk of float32 rows (`_CHUNK_VALUES`)."""
    with StderrProgress(progress_mode(progress)) as display:
        bar = display.task(f"Importing {label or path.name}")
        bar.phase("reading GGUF header")
        reader = _open_reader(path)
        meta = _metadata(reader)
        arch_name = meta.get("general.architecture", "?")
        arch = ARCHITECTURES.get(arch_name)
        if arch is None:
            raise ModelLoadError(
                f"{path.name}: GGUF architecture '{arch_name}' is not supported "
                f"(mlx-spec imports: {', '.join(sorted(ARCHITECTURES))})")
        source = _TensorSource(path, reader)
        try:
            config = arch.config(meta, source.shapes, source.read)
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise ModelLoadError(f"{path.name}: unsupported or incomplete {arch_name} "
                                 f"metadata ({error})") from None

        model = _skeleton(config)
        n_layers = (config.get("text_config") or config)["num_hidden_layers"]
        names = _gguf_names(arch, model, n_layers, source.shapes)
        norms = _norm_parameters(model, arch.norm_class)
        quantizable = _quantizable(model) if storage == "quantized" else {}
        quantized = {}  # module path -> {"group_size", "bits"}
        weights_at = Counter()  # (bits, group size) -> weights quantized so
        bar.phase("dequantizing" if storage == "float16" else "quantizing", total=len(names))
        shard, shard_bytes, shard_files = {}, 0, []
        for mlx_name, (gguf_name, shape) in names.items():
            module = mlx_name.removesuffix(".weight")
            bits = quantizable.get(module) and QUANT_BITS.get(source.type_name(gguf_name))
            group_size = EXACT_GROUP_SIZE if source.exact(gguf_name, bits) else QUANT_GROUP_SIZE
            if bits and shape[-1] % group_size:
                bits = None  # rows not a whole number of groups: stays float16
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
    for key, field_ in reader.fields.items():
        try:
            meta[key] = field_.contents()
        except (ValueError, UnicodeDecodeError):  # undecodable optional fields: skip
            continue
    return meta


def _skeleton(config: dict):
    """The mlx-lm model for `config` (our class for an MTP assistant), parameters
    unevaluated: only names, shapes and module types are used."""
    from mlx_spec.models import gemma4_assistant

    model_class, args_class = gemma4_assistant.assistant_classes(config)
    model = model_class(args_class.from_dict(config))
    if config.get("tie_word_embeddings") and hasattr(model, "sanitize") \
            and not gemma4_assistant.is_assistant_config(config):
        model.sanitize({})  # no lm_head weight: the model ties it to the embedding
    return model


def _gguf_names(arch: GGUFArchitecture, model, n_layers: int, shapes: dict) -> dict:
    """mlx-lm parameter name -> (GGUF tensor name, expected shape), via gguf's own name map
    (and `arch.extra_names`). A parameter without a suffix (Gemma 4's `layer_scalar`) is
    stored with ".weight" appended, as llama.cpp's converter does."""
    import gguf
    from mlx.utils import tree_flatten

    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch.names]
    name_map = gguf.get_tensor_name_map(arch_id, n_layers)
    names = {}
    for mlx_name, param in tree_flatten(model.parameters()):
        gguf_name = arch.extra_names.get(mlx_name) or name_map.get_name(mlx_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelLoadError(f"no GGUF tensor name known for mlx-lm parameter {mlx_name}")
        if gguf_name not in shapes and f"{gguf_name}.weight" in shapes:
            gguf_name = f"{gguf_name}.weight"
        names[mlx_name] = (gguf_name, tuple(param.shape))
    return names


def _norm_parameters(model, class_name: str) -> set[str]:
    return {f"{path}.weight" for path, module in model.named_modules()
            if type(module).__name__ == class_name}


def _quantizable(model) -> dict[str, bool]:
    """Module paths a quantized import may quantize: the layers with `to_quantized`
    (linear, embedding) that the model's own `quant_predicate` does not exclude."""
    predicate = getattr(model, "quant_predicate", None)
    return {path: True for path, module in model.named_modules()
            if hasattr(module, "to_quantized") and (predicate is None or predicate(path, module))}


class _TensorSource:
    """The tensors of one GGUF file, read with plain file reads rather than through the
    reader's memory map, so pages read once are not counted in our memory for the rest of
    the import (a 12B file is ~7 GB)."""

    def __init__(self, path: Path, reader):
        self.path = path
        self.tensors = {t.name: t for t in reader.tensors}
        self.shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in self.tensors.items()}
        self.file = open(path, "rb")  # closed with the object; the import is short-lived

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name if name in self.tensors else "?"

    def exact(self, name: str, bits: int | None) -> bool:
        """Whether tensor `name` re-encodes exactly as MLX `bits`-bit groups of 32."""
        return bits is not None and _EXACT_BITS.get(self.type_name(name)) == bits

    def raw(self, name: str, rows: slice):
        """The stored bytes of some rows of tensor `name`, [rows, bytes per row]."""
        import gguf
        import numpy as np  # here: a cached load imports this module but needs no numpy

        tensor = self.tensors[name]
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        row_bytes = self.shapes[name][-1] // block_values * block_bytes
        count = (rows.stop - rows.start) * row_bytes
        data = os.pread(self.file.fileno(), count, int(tensor.data_offset) + rows.start * row_bytes)
        if len(data) < count:
            raise ValueError(f"data ends {count - len(data)} bytes early")
        return np.frombuffer(data, dtype=np.uint8).reshape(-1, row_bytes)

    def read(self, name: str, rows: slice | None = None):
        """Dequantized float32 values of tensor `name` [rows, row width], or some rows."""
        import gguf
        import numpy as np

        tensor = self.tensors[name]
        shape = self.shapes[name]
        width, n_rows = shape[-1], int(np.prod(shape[:-1], dtype=np.int64))
        data = self.raw(name, rows or slice(0, n_rows))
        if tensor.tensor_type.name in ("F32", "F16"):  # stored as plain arrays
            return data.view(np.float32 if tensor.tensor_type.name == "F32" else np.float16) \
                .astype(np.float32).reshape(-1, width)
        values = gguf.quants.dequantize(data, tensor.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape(-1, width)

    def convert(self, name: str, shape: tuple, offset: float, bits: int | None) -> list[mx.array]:
        """Tensor `name` as `shape`: [float16 weight] (float32 past float16's range), or the
        MLX-quantized [weight, scales, biases] at `bits`; a chunk of rows at a time."""
        import numpy as np

        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path.name} has no tensor {name}; the file is incomplete")
        if self.shapes[name] != shape:
            raise ModelLoadError(f"{self.path.name}: tensor {name} has shape {self.shapes[name]}, "
                                 f"the model expects {shape}")
        width = shape[-1]
        n_rows = int(np.prod(shape[:-1], dtype=np.int64))
        step = max(1, _CHUNK_VALUES // width)
        parts = []
        exact = self.exact(name, bits)
        for start in range(0, n_rows, step):
            rows = slice(start, min(n_rows, start + step))
            try:
                if exact:
                    parts.append(_exact_affine(self.raw(name, rows), tensor.tensor_type.name, width))
                    mx.eval(parts[-1])
                    continue
                values = self.read(name, rows)
            except NotImplementedError:
                raise ModelLoadError(f"{self.path.name}: tensor {name} uses {tensor.tensor_type.name}, "
                                     "which the gguf package cannot dequantize") from None
            except (ValueError, IndexError) as error:  # data shorter than its header says
                raise ModelLoadError(f"{self.path.name}: tensor {name} is damaged ({error})") from None
            if offset:
                values = values - offset
            if not np.isfinite(values).all():
                raise ModelLoadError(f"{self.path.name}: tensor {name} holds NaN or infinite values")
            parts.append(self._store(values, bits))
            mx.eval(parts[-1])  # free the float32 rows before reading the next chunk
        arrays = [mx.concatenate(column) if len(column) > 1 else column[0] for column in zip(*parts)]
        if len(arrays) == 1:
            arrays[0] = arrays[0].reshape(shape)
        mx.eval(arrays)
        return arrays

    @staticmethod
    def _store(values, bits: int | None) -> list[mx.array]:
        import numpy as np

        if bits:
            weight, scales, biases = mx.quantize(mx.array(values), group_size=QUANT_GROUP_SIZE, bits=bits)
            return [weight, scales.astype(mx.float16), biases.astype(mx.float16)]
        if STORAGE_DTYPE == mx.float16 and np.abs(values).max(initial=0.0) > 60_000:
            return [mx.array(values)]  # beyond float16's range (65504): keep float32
        return [mx.array(values).astype(STORAGE_DTYPE)]

    def __del__(self):
        if getattr(self, "file", None) is not None:
            self.file.close()


_EXACT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8}


def _exact_affine(raw, type_name: str, width: int) -> list[mx.array]:
    """Rows of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or Q4_K blocks [rows, bytes per row] as MLX affine
    groups of 32: [packed weight, scales, biases], holding the same values (scales and biases
    rounded to float16). Q8_0: x = d·q, q in [-128, 127]; Q4_0: x = d·(q − 8); Q5_0:
    x = d·(q − 16); Q4_1, Q5_1: x = d·q + m; Q4_K: 8 sub-blocks of 32 per 256,
    x = (d·sc)·q − dmin·m. MLX: x = scale·q + bias, q unsigned, packed low bits first."""
    import gguf
    import numpy as np

    def half(columns):
        return columns.copy().view(np.float16).astype(np.float32)

    def nibbles(qs):  # 16 bytes: value j in the low nibble, value j + 16 in the high one
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    rows = raw.shape[0]
    if type_name == "Q8_0":  # [d f16][32 × int8]
        blocks = raw.reshape(-1, 34)
        d = half(blocks[:, :2])
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scale, bias = d, -128.0 * d
    elif type_name == "Q4_0":  # [d f16][16 bytes of nibbles]
        blocks = raw.reshape(-1, 18)
        d = half(blocks[:, :2])
        q = nibbles(blocks[:, 2:])
        scale, bias = d, -8.0 * d
    elif type_name == "Q4_1":  # [d f16][m f16][16 bytes of nibbles]
        blocks = raw.reshape(-1, 20)
        q = nibbles(blocks[:, 4:])
        scale, bias = half(blocks[:, :2]), half(blocks[:, 2:4])
    elif type_name in ("Q5_0", "Q5_1"):  # [d f16]([m f16])[qh: bit j = value j's fifth bit][nibbles]
        blocks = raw.reshape(-1, 22 if type_name == "Q5_0" else 24)
        start = 2 if type_name == "Q5_0" else 4
        high = blocks[:, start:start + 4].copy().view(np.uint32)  # [blocks, 1]
        fifth = (high >> np.arange(32, dtype=np.uint32)) & 1
        q = nibbles(blocks[:, start + 4:]) | (fifth.astype(np.uint8) << 4)
        d = half(blocks[:, :2])
        scale, bias = (d, -16.0 * d) if type_name == "Q5_0" else (d, half(blocks[:, 2:4]))
    else:  # Q4_K: [d f16][dmin f16][12 bytes of 6-bit scales and mins][128 bytes of nibbles]
        blocks = raw.reshape(-1, 144)
        d, dmin = half(blocks[:, :2]), half(blocks[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        # each 32 bytes hold two sub-blocks: low nibbles the first, high nibbles the second
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 8, 32)
        scale, bias = d * sc.astype(np.float32), -dmin * m.astype(np.float32)
    q = q.reshape(rows, width)
    if not (np.isfinite(scale).all() and np.isfinite(bias).all()):
        raise ValueError("a block's scale is NaN or infinite")
    if _EXACT_BITS[type_name] == 4:  # two values a byte, the first in the low nibble
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    weight = np.ascontiguousarray(q).view(np.uint32)  # little-endian: first byte lowest
    groups = width // EXACT_GROUP_SIZE
    return [mx.array(weight), mx.array(scale.reshape(rows, groups)).astype(mx.float16),
            mx.array(bias.reshape(rows, groups)).astype(mx.float16)]


def _write_shard(out: Path, shard: dict, index: int) -> Path:
    file = out / f"model-{index + 1:05d}.safetensors"
    mx.save_safetensors(str(file), shard, metadata={"format": "mlx"})
    shard.clear()
    mx.clear_cache()  # hand the written arrays' memory back before the next shard
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
