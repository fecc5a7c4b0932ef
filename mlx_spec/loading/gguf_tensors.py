"""Reading a GGUF file's tensors and re-encoding them for MLX: float16 rows, or MLX's affine
quantization, tensor by tensor and a chunk of rows at a time, so the whole float model is
never in memory. Blocks that are already affine over 32 values (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
Q8_0) are re-encoded exactly (`_exact_affine`); every other type is dequantized with the
`gguf` package (`mx.load` decodes Q4_K wrongly and rejects Q5_0) and quantized by MLX.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

from mlx_spec.errors import ModelLoadError

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

# Rows are dequantized this many float32 values at a time (the gguf package's temporaries
# are a few times as large): a 262k-token embedding is 1B values, 4 GB as float32.
_CHUNK_VALUES = 8 << 20


def quantizable_modules(model) -> dict[str, bool]:
    """Module paths a quantized import may quantize: the layers with `to_quantized`
    (linear, embedding) that the model's own `quant_predicate` does not exclude."""
    predicate = getattr(model, "quant_predicate", None)
    return {path: True for path, module in model.named_modules()
            if hasattr(module, "to_quantized") and (predicate is None or predicate(path, module))}


class TensorSource:
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

    def quantization(self, name: str, shape: tuple) -> tuple[int | None, int]:
        """(bits, group size) of tensor `name` (of `shape`) in a quantized import: `QUANT_BITS`
        of its type, in groups of 32 where those re-encode it exactly; bits None (it stays
        float16) for a type not listed."""
        bits = QUANT_BITS.get(self.type_name(name))
        group_size = EXACT_GROUP_SIZE if self.exact(name, bits) else QUANT_GROUP_SIZE
        if bits and shape[-1] % group_size:
            bits = None  # rows not a whole number of groups: stays float16
        return bits, group_size

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
