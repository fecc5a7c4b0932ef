"""Random-weight Gemma 3 GGUF files of any shape, typed as llama.cpp's Q4_K_M writes them,
for measuring a GGUF import's memory at real sizes (bench/gguf_import.py) and small ones
(tests): no real checkpoint of 12B is needed, only its shape.

The blocks are random bytes with a valid float16 scale in every block, so the gguf package
and llama.cpp decode them to finite values (random ±0.01-sized weights). Tensors are written
one at a time: the writer holds one tensor, never the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Q4_K_M, as llama.cpp's llama_tensor_get_type picks types for it: Q6_K for the embedding
# (Gemma ties it to the output) and for attn_v / ffn_down of the "more bits" layers, Q4_K
# for every other matrix, norms in F32.
# Where each block type keeps its float16 scale (and min / dmin): set to valid values.
SCALE_BYTES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2),
               "Q5_0": (0,), "Q5_1": (0, 2)}


def q4_k_m_type(gguf_name: str, n_layers: int) -> str:
    if gguf_name == "token_embd.weight":
        return "Q6_K"
    if gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(gguf_name.split(".")[1])
        more_bits = layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def random_blocks(type_name: str, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] of random `type_name` blocks with float16 scales (and mins) of 1e-3."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, width // block_values * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    for offset in SCALE_BYTES[type_name]:
        blocks[:, offset:offset + 2] = scale
    return raw


def write_random_gemma3_gguf(path: str | Path, config: dict, seed: int = 0) -> Path:
    """Write a Gemma 3 GGUF for the mlx-lm `gemma3_text` config `config` (hidden size,
    layers, heads, vocabulary...), Q4_K_M-typed random weights, a made-up vocabulary."""
    import gguf
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    path = Path(path)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    n_layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(config.get("max_position_embeddings", 32768))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(config.get("sliding_window", 1024))
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    vocab = config["vocab_size"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"▁t{i}" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([3] * len(specials) + [6] * 256 + [1] * (vocab - len(specials) - 256))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n_layers)
    rng = np.random.default_rng(seed)
    planned = []
    for name, param in tree_flatten(model.parameters()):
        if name.startswith("lm_head"):
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight",))
        shape = tuple(param.shape)
        type_name = "F32" if len(shape) == 1 else q4_k_m_type(gguf_name, n_layers)
        planned.append((gguf_name, shape, type_name))
        qtype = gguf.GGMLQuantizationType[type_name]
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block_values * block_bytes
        if type_name == "F32":
            writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), nbytes)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block_values * block_bytes)
            writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for gguf_name, shape, type_name in planned:
        if type_name == "F32":  # a norm: stored as 1 + w, around 1
            writer.write_tensor_data(rng.uniform(0.5, 1.5, shape).astype(np.float32))
        else:
            rows = int(np.prod(shape[:-1]))
            writer.write_tensor_data(random_blocks(type_name, rows, shape[-1], rng).reshape(*shape[:-1], -1))
    writer.close()
    return path


# ---------------------------------------------------------------------------------------
# Peak memory of an import, measured in a fresh process
# ---------------------------------------------------------------------------------------


def _rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (high-water mark) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def import_peak_memory(gguf_path: str | Path, cache_root: str | Path, *, storage: str = "quantized",
                       shard_bytes: int | None = None, chunk_values: int | None = None) -> dict:
    """Import `gguf_path` in a new Python process and report its memory: `rss_before` (after
    the imports the conversion needs, before it starts), `peak_rss` (high-water mark of the
    whole process), `output_bytes` (the safetensors written) and `seconds`."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "mlx_spec.testing.random_gguf", str(gguf_path), str(cache_root), storage,
            str(shard_bytes or 0), str(chunk_values or 0)]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the import failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(gguf_path: str, cache_root: str, storage: str, shard_bytes: int, chunk_values: int) -> dict:
    import time

    import mlx_lm.models.gemma3_text  # noqa: F401  (what the import loads, before the baseline)
    import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401

    # Imported here, in the measuring child only, after the modules its RSS baseline includes.
    from mlx_spec.loading import gguf_import, gguf_tensors

    if shard_bytes:
        gguf_import._SHARD_BYTES = shard_bytes
    if chunk_values:
        gguf_tensors._CHUNK_VALUES = chunk_values
    before = _rss_bytes("VmRSS")
    start = time.perf_counter()
    folder = gguf_import.import_gguf(Path(gguf_path), Path(cache_root), storage=storage, progress=False)
    seconds = time.perf_counter() - start
    return {"rss_before": before, "peak_rss": _rss_bytes("VmHWM"), "seconds": round(seconds, 1),
            "output_bytes": sum(f.stat().st_size for f in folder.glob("model*.safetensors")),
            "folder": str(folder)}


if __name__ == "__main__":
    import json
    import sys

    path, root, storage_, shard, chunk = sys.argv[1:6]
    print(json.dumps(_child(path, root, storage_, int(shard), int(chunk))))
