"""Gemma 4 targets through every existing path: a tiny random-weight Gemma 4 (KV-shared
layers, sliding window 16) written to disk and loaded by the real loader; greedy output
identical to mlx-lm's plain generate_step for every γ and drafter, across the window;
rollback exact at the logits level; multi-turn chat reuse; turn tokens and chat template."""

import json

import mlx.core as mx
import pytest
from conftest import chat_turn_matches_plain_decoding, greedy_reference
from mlx.utils import tree_flatten

from mlx_spec.apps.conversation import ChatSession
from mlx_spec.core.engine import Engine
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.loading import load_model, load_pair
from mlx_spec.testing.tiny import TINY_VOCAB
from mlx_spec.testing.tiny_gemma4 import END_OF_TURN_ID, WINDOW, save_tiny_gemma4, tiny_gemma4

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]  # shorter than the window
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]  # longer than the window
MAX_TOKENS = 40  # every generation crosses the window


pytest_plugins = ["cli_fixtures"]  # fixtures: gemma4_dirs


@pytest.fixture(scope="module")
def pair(gemma4_dirs):
    return load_pair(str(gemma4_dirs / "target"), str(gemma4_dirs / "draft"), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def references(pair):
    model = pair.target.model
    return {"short": greedy_reference(model, SHORT_PROMPT, MAX_TOKENS),
            "long": greedy_reference(model, LONG_PROMPT, MAX_TOKENS)}


def run(engine, prompt, gamma, max_tokens=MAX_TOKENS, **kwargs):
    stats = Stats()
    rounds = engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats, **kwargs)
    return [t for r in rounds for t in r.tokens], stats


def test_loaded_through_the_real_loader(pair):
    model = pair.target.model
    assert pair.target.config["model_type"] == "gemma4_text"
    assert model.model.previous_kvs == [0, 1, 2, 1, 1, 2]  # layers 3-5 reuse 1 and 2
    assert pair.vocab_size_target == pair.vocab_size_draft == TINY_VOCAB
    assert END_OF_TURN_ID in pair.tokenizer.eos_token_ids


@pytest.mark.parametrize("prompt_name", ["short", "long"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
@pytest.mark.parametrize("drafter_name", ["model", "ngram"])
def test_greedy_matches_plain_decoding(pair, references, prompt_name, gamma, drafter_name):
    prompt = SHORT_PROMPT if prompt_name == "short" else LONG_PROMPT
    if drafter_name == "model":
        drafter = ModelDrafter(pair.draft.model, TINY_VOCAB)
    else:
        drafter = NgramDrafter(min_ngram=1)
    tokens, stats = run(Engine(pair.target.model, drafter), prompt, gamma)
    assert tokens == references[prompt_name]
    assert len(prompt) + len(tokens) > WINDOW + gamma + 1
    if drafter_name == "model":  # it really speculated: some drafts accepted, some rejected
        assert 0 < stats.accepted < stats.drafted


def test_rollback_is_exact_at_the_logits_level(pair):
    """After a speculative run far past the window (many rollbacks), the target's cache
    gives the same next-token logits as a fresh prefill of the same ids."""
    model = pair.target.model
    engine = Engine(model, ModelDrafter(pair.draft.model, TINY_VOCAB))
    cache = engine.make_prompt_cache()
    tokens, _ = run(engine, LONG_PROMPT, 5, 60, prompt_cache=cache)
    ids = LONG_PROMPT + tokens
    assert cache.target.ids == ids[:-1]
    speculative = cache.target.forward(mx.array(ids[-1:]))
    fresh = model(mx.array(ids)[None])[0, -1:]
    assert mx.allclose(speculative, fresh, atol=1e-4).item()


def test_chat_session_reuses_the_cache_across_turns(pair):
    """Turn 2 prefills only its new tokens and still equals plain decoding of the whole
    conversation."""
    tokenizer = pair.tokenizer
    engine = Engine(pair.target.model, ModelDrafter(pair.draft.model, TINY_VOCAB),
                    eos_ids=tokenizer.eos_token_ids)
    session = ChatSession(engine, tokenizer, system="Be brief.")
    chat_turn_matches_plain_decoding(session, pair.target.model, "Hello there, who are you?")
    stats = chat_turn_matches_plain_decoding(session, pair.target.model, "And what is next?")
    assert stats.prefill_tokens < stats.prompt_tokens  # both models prefill: 2·(prompt − 1) without reuse
    assert session.cache.target.ids[:1] == [tokenizer.bos_token_id]


def test_turn_tokens_and_chat_template(gemma4_dirs, pair):
    tokenizer = pair.tokenizer
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|turn>system\nS<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    # A checkpoint without a template gets Gemma 4's, and still stops at <turn|>.
    bare = load_model(str(gemma4_dirs / "bare"), progress=False).tokenizer
    assert bare.has_chat_template
    assert bare.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert END_OF_TURN_ID in bare.eos_token_ids


def test_multimodal_wrapper_checkpoint(tmp_path, pair, references):
    """A `gemma4` checkpoint (text model under model.language_model, as the hub's Gemma 4
    builds store it) loads through mlx-lm's wrapper and decodes identically."""
    text, text_config = pair.target.model, pair.target.config
    folder = save_tiny_gemma4(tmp_path / "wrapped", tiny_gemma4(seed=0))  # tokenizer files
    config = {"model_type": "gemma4", "vocab_size": TINY_VOCAB, "text_config": text_config,
              "eos_token_id": text_config["eos_token_id"]}
    (folder / "config.json").write_text(json.dumps(config))
    weights = {"model.language_model." + k.removeprefix("model."): v
               for k, v in tree_flatten(text.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    loaded = load_model(str(folder), dtype="float32", progress=False)
    assert type(loaded.model).__module__.endswith("gemma4")
    drafter = ModelDrafter(pair.draft.model, TINY_VOCAB)
    tokens, _ = run(Engine(loaded.model, drafter), LONG_PROMPT, 3)
    assert tokens == references["long"]
