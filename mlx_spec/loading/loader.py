"""One entry point, `load_model`, for every way a user names a model (see `sources`).

Models are mlx-lm's own classes; `load_model` finds the files (`sources`), reads the weights
(`checkpoints`) and the tokenizer (`tokenizer_loading`), then applies the dtype and optional
quantization that suit the device.
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.errors import UsageError
from mlx_spec.loading import checkpoints, gguf_import, sources
from mlx_spec.models import drafts
from mlx_spec.loading.arrays import evaluate_all
from mlx_spec.loading.fast_tokenizer import fast_loadable
from mlx_spec.loading.sharding import shard_model
from mlx_spec.loading.tokenizer_loading import read_tokenizer, with_turn_ends
from mlx_spec.models.vision import Vision, load_vision
from mlx_spec.progress import StderrProgress

if TYPE_CHECKING:  # importing it costs transformers (~1 s); see fast_tokenizer
    from mlx_lm.tokenizer_utils import TokenizerWrapper

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


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
        vision: the checkpoint's vision tower and processor (`mlx_spec.models.vision.Vision`,
            through mlx-vlm), or None for a model that reads no images.
    """

    model: nn.Module
    tokenizer: TokenizerWrapper | None
    config: dict
    source: str
    path: Path
    kind: str
    vision: Vision | None = None

    @property
    def context_length(self) -> int | None:
        """Positions the model was trained for (config max_position_embeddings), if known."""
        return checkpoints.context_length(self.config)


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
               progress: bool = True, group=None, for_chat: bool | str = False,
               chat_template: str | None = None) -> LoadedModel:
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
        chat_template: a template's text that replaces the checkpoint's (`--chat-template`).
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

    path, kind = sources.resolve_source(source, progress=progress)
    # A spinner on a terminal while the weights load; piped, the summary line stays alone.
    with StderrProgress("bars" if progress and sys.stderr.isatty() else "off") as display:
        display.task(f"loading {source or sources.DEFAULT_SOURCE}").phase()
        model, config = checkpoints.load_folder(path, dtype=dtype)
        optional = drafts.draft_family(config) is not None  # drafts may ship no tokenizer
        # a --chat-template is rendered as soon as a prompt is, except in an interactive
        # chat ("later"), whose FastTokenizer builds mlx-lm's with it behind the prompt
        templates_now = for_chat is True or (chat_template is not None and for_chat != "later")
        if not templates_now and gguf_import.is_imported(path) and fast_loadable(path) is not None:
            # Reading its tokenizer (from its index ~0.1 s; a first load parses tokenizer.json
            # whole, ~1.5 s for the 270M, holding the GIL) overlaps MLX reading the weights
            # below, which releases the GIL.
            reading = _InBackground(read_tokenizer, path, config, optional, True, chat_template)
        else:  # mlx-lm's tokenizer imports transformers: not on a thread of ours
            reading = None
            tokenizer = with_turn_ends(read_tokenizer(path, config, optional, fast=not templates_now,
                                                      chat_template=chat_template), config)
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
            shard_model(model, group)
            # Weights are still lazy: evaluating layer by layer frees each layer's full
            # tensors once its shard is cut, so a rank never holds the whole model at once.
            for layer in model.layers:
                mx.eval(layer.parameters())
        evaluate_all(model)
        if quantize is None and group is None and checkpoints.float32_copy_due(path, dtype, config):
            checkpoints.write_float32_copy(path)
        if reading is not None:
            tokenizer = with_turn_ends(reading.result(), config)
        vision = load_vision(path, config, model) if group is None else None
    return LoadedModel(model, tokenizer, config, source or sources.DEFAULT_SOURCE, path, kind, vision)


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
