"""Shared by several test modules; moved from test_models_gguf.py."""

import random
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_spec.testing.tiny import SPECIAL_TOKENS
from mlx_spec.testing.tiny_gemma4 import save_hf_checkpoints

# The importer assumes Gemma 3's fixed layout (global layer every 6th), so the tiny model
# used here has 6 layers with that pattern: five sliding, one global.
TINY_GGUF_CONFIG = dict(num_hidden_layers=6, sliding_window_pattern=6)


def write_tiny_gguf(path, model, architecture="gemma3"):
    """Write `model` as llama.cpp would: renamed tensors, RMSNorm weights stored as 1 + w,
    matrices in Q8_0. Returns the mlx-lm parameters as the GGUF now holds them (Q8_0
    round-tripped), for building an exact reference."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_sliding_window(config["sliding_window"])
    tokens, types = tiny_gguf_tokens()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config["num_hidden_layers"])
    stored = {}
    for name, value in tree_flatten(model.parameters()):
        if name.startswith("lm_head"):
            continue
        values = np.array(value.astype(mx.float32))
        gguf_name = name_map.get_name(name, try_suffixes=(".weight",))
        if values.ndim == 1:  # every 1-D parameter of gemma3_text is an RMSNorm weight
            writer.add_tensor(gguf_name, values + 1.0)
            stored[name] = values
        else:
            blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored[name] = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def random_texts(tokens: list[str], count: int, seed: int = 0, added: list[str] | None = None) -> list[str]:
    """Runs of vocabulary pieces (with ▁ as spaces), stray characters, whitespace runs and
    added tokens (`added`, else this module's): text where many merges compete, and byte
    fallback."""
    added = added or SPECIALS + ADDED + [BEYOND]
    rnd = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rnd.randint(1, 40)):
            r = rnd.random()
            if r < 0.6:
                parts.append(rnd.choice(tokens).replace("▁", " "))
            elif r < 0.75:
                parts.append(_character(rnd))
            elif r < 0.8:
                parts.append(rnd.choice(added))
            else:
                parts.append(rnd.choice([" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", ".", ",", "▁"]))
        texts.append("".join(parts))
    return texts


def gguf_file(name: str, outtype: str = "f32") -> Path:
    return DATA / f"tiny-gemma4-{name}-{outtype}.gguf"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{name: Hugging Face folder} the committed GGUFs were converted from."""
    return save_hf_checkpoints(tmp_path_factory.mktemp("hf"))


DATA = Path(__file__).parent / "data"


def tiny_gguf_tokens():
    """Gemma-style SentencePiece vocabulary: specials, 256 byte tokens, a few pieces
    (272 in all, the tiny model's vocabulary width)."""
    tokens = list(SPECIAL_TOKENS) + [f"<0x{b:02X}>" for b in range(256)] + TINY_PIECES
    types = [3] * len(SPECIAL_TOKENS) + [6] * 256 + [1] * len(TINY_PIECES)  # control, byte, normal
    return tokens, types


SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


ADDED = ["<table>", "<td>"]  # non-special added tokens, as Gemma's vocabulary has


BEYOND = "<mask>"  # an added token numbered after the vocabulary (transformers' GGUF import adds one)


def _character(rnd: random.Random) -> str:
    while True:
        code = rnd.choice([rnd.randint(0x20, 0x7E), rnd.randint(0xA0, 0x2FFF), rnd.randint(0x1F300, 0x1FAFF)])
        if not 0xD800 <= code <= 0xDFFF:
            return chr(code)


TINY_PIECES = ["▁", "▁t", "he", "▁the", "▁a", "in", "er", "an", "on", "▁s"]
