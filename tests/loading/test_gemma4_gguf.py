"""Gemma 4 GGUFs as llama.cpp's converter writes them: target and MTP assistant.

tests/data/tiny-gemma4-*.gguf were produced by llama.cpp's own `convert_hf_to_gguf.py` from
Hugging Face folders that `save_hf_checkpoints` rebuilds here bit for bit (numpy seeds; see
tests/data/make_gemma4_gguf.py). The independent references are those folders loaded as any
checkpoint (mlx-lm's class, the HF tokenizer) and mlx-lm's plain greedy `generate_step`.
"""

import json

import mlx.core as mx
import pytest
from conftest import greedy_reference
from gguf_support import (  # noqa: F401
    DATA,  # noqa: F401
    gguf_file,
    hf,
    random_texts,
)
from mlx_lm.models.cache import KVCache
from tokenizers import Tokenizer

import mlx_spec.loading.gguf_import as gguf_import
import mlx_spec.loading.gguf_tensors as gguf_tensors
from mlx_spec.apps.runner import build_engine
from mlx_spec.core.stats import Stats
from mlx_spec.loading import load_model, load_pair
from mlx_spec.loading.tokenizer_index import TokenizerIndex
from mlx_spec.models.gemma4_assistant import last_kv_layers
from mlx_spec.testing.tiny_gemma4 import WINDOW

PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]  # longer than the 16-token window
TEXTS = ["the cat ate a hat", "  Hello,\nthe world! ½ ünïcode 😀", "<|turn>user\nhi<turn|>"]



@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def exact(monkeypatch):
    """float32 storage: the llama.cpp f32 files then import exactly."""
    monkeypatch.setattr(gguf_tensors, "STORAGE_DTYPE", mx.float32)


@pytest.mark.parametrize("name", ["e2b", "12b"])
def test_target_logits_equal_the_hf_load(hf, cache, exact, name):
    reference = load_model(str(hf[name]), dtype="float32", progress=False)
    imported = load_model(str(gguf_file(name)), dtype="float32", progress=False)
    assert imported.kind == "gguf" and imported.config["model_type"] == "gemma4_text"
    ids = mx.array([PROMPT])
    expected, got = reference.model(ids), imported.model(ids)
    assert mx.allclose(got, expected, atol=1e-4).item()


@pytest.mark.parametrize("name", ["e2b", "12b"])
def test_float16_import_keeps_the_greedy_choices(hf, cache, name):
    reference = load_model(str(hf[name]), dtype="float32", progress=False)
    imported = load_model(str(gguf_file(name)), dtype="float32", progress=False)
    assert json.loads((imported.path / "mlx_spec_source.json").read_text())["storage"] == "float16"
    ids = mx.array([PROMPT])
    expected, got = reference.model(ids), imported.model(ids)
    # float16 weights: logits (soft-capped at 30) within 1 (measured 0.10 / 0.37), same argmax
    assert mx.abs(got - expected).max().item() < 1.0
    assert (mx.argmax(got, -1) == mx.argmax(expected, -1)).all().item()


@pytest.mark.parametrize("name", ["e2b", "12b"])
def test_config_states_the_architecture(hf, cache, name):
    """Layer pattern, head sizes, K = V, KV sharing, per-layer inputs, double-wide MLP and
    partial RoPE all come back from the metadata as the HF config states them."""
    stated = json.loads((hf[name] / "config.json").read_text())
    config = load_model(str(gguf_file(name)), progress=False).config
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "head_dim", "global_head_dim", "num_key_value_heads", "num_kv_shared_layers",
                "hidden_size_per_layer_input", "vocab_size", "sliding_window", "layer_types",
                "attention_k_eq_v", "use_double_wide_mlp", "final_logit_softcapping", "tie_word_embeddings"):
        assert config[key] == stated[key], key
    full = stated["rope_parameters"]["full_attention"]
    assert config["rope_parameters"]["full_attention"] == full
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert config["num_global_key_value_heads"] == (stated["num_global_key_value_heads"]
                                                    or stated["num_key_value_heads"])


def test_tokenizer_equals_the_hf_tokenizer(hf, cache):
    reference = load_model(str(hf["12b"]), progress=False).tokenizer
    imported = load_model(str(gguf_file("12b")), progress=False).tokenizer
    for text in TEXTS:
        assert imported.encode(text) == reference.encode(text), text
        assert imported.decode(imported.encode(text)) == reference.decode(reference.encode(text))
    assert imported.eos_token_ids == reference.eos_token_ids == {1, 5}  # <eos>, <turn|>
    messages = [{"role": "user", "content": "hi"}]
    assert imported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_tokenizer_index_of_the_import_encodes_as_the_whole_tokenizer(cache):
    """The import's tokenizer.json (Gemma 4's layout) gets an index on its first load, and a
    warm load's index encodes as `tokenizers` does with the whole file: turn tokens, text
    around them, byte fallback, non-ASCII."""
    folder = load_model(str(gguf_file("12b")), progress=False).path  # parsed whole, the index written
    warm = load_model(str(gguf_file("12b")), progress=False).tokenizer
    assert isinstance(warm._backend, TokenizerIndex)
    whole = Tokenizer.from_file(str(folder / "tokenizer.json"))
    added = [t["content"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]]
    assert {"<|turn>", "<turn|>"} <= set(added)  # the tiny vocabulary has no tool-call tokens
    vocab = [whole.id_to_token(i) for i in range(whole.get_vocab_size(with_added_tokens=False))]
    texts = TEXTS + random_texts(vocab, 200, added=added) + [
        "<|turn>system\nnaïve café Straße 日本語 🤗 €<turn|>\n<|turn>model\n", "<|turn><turn|><bos><eos><mask>",
        "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>", " the  hat\t\r\n<turn|>the"]
    for text in texts:
        assert warm.encode(text) == whole.encode(text).ids, text
        assert warm.encode(text, add_special_tokens=False) == whole.encode(text, add_special_tokens=False).ids


def target_kv_and_hidden(target, prompt):
    """The assistant's inputs after a target pass over prompt[:-1], from mlx-lm's own caches:
    the shared K/V of the target's last non-shared layers and the last hidden state."""
    inner = target.model
    cache = [KVCache() for _ in target.make_cache()]
    h = inner(mx.array([prompt[:-1]]), cache=cache)[:, -1:, :]
    held = len(prompt) - 1
    layers = last_kv_layers(target.args)
    first = max(0, held - (WINDOW - 1))
    s, f = cache[layers["sliding_attention"]], cache[layers["full_attention"]]
    kv = {"sliding_attention": (s.keys[..., first:held, :], s.values[..., first:held, :]),
          "full_attention": (f.keys[..., :held, :], f.values[..., :held, :])}
    embedded = inner.embed_tokens(mx.array([[prompt[-1]]])) * inner.embed_scale
    return mx.concatenate([embedded, h], axis=-1), kv, held


def test_assistant_draft_logits_equal_the_hf_load(hf, cache, exact):
    reference = load_pair(str(hf["12b"]), str(hf["12b-assistant"]), dtype="float32", progress=False)
    imported = load_pair(str(gguf_file("12b")), str(gguf_file("12b-assistant")), dtype="float32",
                         progress=False)
    assert imported.draft.config["model_type"] == "gemma4_unified_assistant"
    assert imported.draft.config["backbone_hidden_size"] == 64
    x, kv, position = target_kv_and_hidden(reference.target.model, PROMPT)
    for _ in range(3):  # three chained draft steps: logits and the next step's h
        expected_logits, expected_h = reference.draft.model(x, kv, position)
        got_logits, got_h = imported.draft.model(x, kv, position)
        assert mx.allclose(got_logits, expected_logits, atol=1e-4).item()
        assert mx.allclose(got_h, expected_h, atol=1e-4).item()
        token = mx.argmax(expected_logits, axis=-1)
        inner = reference.target.model.model
        x = mx.concatenate([inner.embed_tokens(token) * inner.embed_scale, expected_h], axis=-1)
        position += 1


def run(pair, prompt, gamma, max_tokens=40):
    stats = Stats()
    rounds = build_engine(pair).rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats)
    return [t for r in rounds for t in r.tokens], stats


@pytest.fixture(scope="module")
def hf_reference(hf):
    target = load_model(str(hf["12b"]), dtype="float32", progress=False).model
    return greedy_reference(target, PROMPT, 40)


@pytest.mark.parametrize("gamma", [1, 3])
def test_speculative_output_from_the_imported_pair_equals_plain_decoding(hf_reference, cache, exact, gamma):
    pair = load_pair(str(gguf_file("12b")), str(gguf_file("12b-assistant")), dtype="float32", progress=False)
    tokens, stats = run(pair, PROMPT, gamma)
    assert stats.drafted > 0
    assert tokens == greedy_reference(pair.target.model, PROMPT, 40) == hf_reference


def test_quantized_import_of_llama_cpp_q8_0(cache):
    """Q8_0 tensors become MLX 8-bit layers of groups of 32 holding the same values (to float16
    rounding of the scales); the greedy speculative output of the quantized pair equals
    plain decoding of its target."""
    folders = {name: gguf_import.import_gguf(gguf_file(name, "q8_0"), cache, storage="quantized",
                                             progress=False) for name in ("12b", "12b-assistant")}
    assert all(folder.name.endswith("-mlxq") for folder in folders.values())
    config = json.loads((folders["12b"] / "config.json").read_text())
    assert config["quantization"]["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 8}
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert (config["quantization"]["bits"], config["quantization"]["group_size"]) == (8, 32)  # shown by info
    pair = load_pair(str(folders["12b"]), str(folders["12b-assistant"]), dtype="float32", progress=False)
    assert pair.target.model.model.layers[0].self_attn.q_proj.weight.dtype == mx.uint32
    tokens, stats = run(pair, PROMPT, 3)
    assert stats.drafted > 0 and tokens == greedy_reference(pair.target.model, PROMPT, 40)
    # against the same file's float16 import: as close as float16 storage is to float32
    # (measured 0.17; MLX quantizing the dequantized values at 8 bits, groups of 64: 4.9)
    float16 = load_model(str(gguf_file("12b", "q8_0")), dtype="float32", progress=False)
    ids = mx.array([PROMPT])
    expected, got = float16.model(ids), pair.target.model(ids)
    assert mx.abs(got - expected).max().item() < 1.0
    assert (mx.argmax(got, -1) == mx.argmax(expected, -1)).all().item()
