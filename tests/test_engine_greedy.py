"""Temperature 0: speculative output is token-identical to plain greedy decoding of the
target (mlx-lm's generate_step), for every γ and drafter, across the sliding window."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conftest import greedy_reference
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.engine import Engine
from mlx_spec.models.tiny import TINY_VOCAB, perturbed_copy, tiny_gemma3
from mlx_spec.stats import Stats

WINDOW = 16
SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]  # shorter than the window
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(44)]  # longer than the window
MAX_TOKENS = 48  # every generation crosses the window


def run(engine, prompt, gamma, max_tokens=MAX_TOKENS, **kwargs):
    stats = Stats()
    tokens = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats, **kwargs) for t in r.tokens]
    return tokens, stats


@pytest.fixture(scope="module")
def references(tiny_target):
    return {
        "short": greedy_reference(tiny_target, SHORT_PROMPT, MAX_TOKENS),
        "long": greedy_reference(tiny_target, LONG_PROMPT, MAX_TOKENS),
    }


@pytest.mark.parametrize("prompt_name", ["short", "long"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("drafter_name", ["model", "ngram"])
def test_greedy_matches_plain_decoding(tiny_target, tiny_draft, references, prompt_name, gamma, drafter_name):
    prompt = SHORT_PROMPT if prompt_name == "short" else LONG_PROMPT
    drafter = ModelDrafter(tiny_draft, TINY_VOCAB) if drafter_name == "model" else NgramDrafter()
    tokens, stats = run(Engine(tiny_target, drafter), prompt, gamma)
    assert tokens == references[prompt_name]
    assert len(prompt) + len(tokens) > WINDOW
    if drafter_name == "model":
        # the run really speculated: drafts were made, some accepted and some rejected
        assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
        assert stats.target_forwards < MAX_TOKENS


def test_gamma_zero_is_plain_decoding(tiny_target, tiny_draft, references):
    tokens, stats = run(Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)), LONG_PROMPT, 0)
    assert tokens == references["long"]
    assert stats.drafted == 0 and stats.target_forwards == MAX_TOKENS


def test_no_drafter_is_plain_decoding(tiny_target, references):
    tokens, _ = run(Engine(tiny_target), SHORT_PROMPT, 3)
    assert tokens == references["short"]


def test_long_generation_far_past_the_window(tiny_target, tiny_draft):
    """Many wraps of the window, rollbacks at every offset modulo the window."""
    reference = greedy_reference(tiny_target, SHORT_PROMPT, 160)
    tokens, _ = run(Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB)), SHORT_PROMPT, 4, 160)
    assert tokens == reference


def resized_vocab(model, vocab_size, seed=5):
    """A perturbed copy of `model` whose (tied) embedding is cut or padded to vocab_size rows."""
    resized = tiny_gemma3(seed=seed, vocab_size=vocab_size)
    weights = dict(tree_flatten(perturbed_copy(model, noise=0.02, seed=1).parameters()))
    embed = weights["model.embed_tokens.weight"]
    if vocab_size <= embed.shape[0]:
        embed = embed[:vocab_size]
    else:
        embed = mx.concatenate([embed, resized.model.embed_tokens.weight[embed.shape[0]:]])
    weights["model.embed_tokens.weight"] = embed
    resized.load_weights(list(weights.items()))
    return resized


def test_draft_with_narrower_vocabulary(tiny_target):
    """Padded vocab widths differ (262 vs 272 here, 262144 vs 262208 for Gemma 3)."""
    narrow = resized_vocab(tiny_target, 262)
    reference = greedy_reference(tiny_target, LONG_PROMPT, 32)
    tokens, stats = run(Engine(tiny_target, ModelDrafter(narrow, TINY_VOCAB)), LONG_PROMPT, 3, 32)
    assert tokens == reference
    assert stats.accepted > stats.drafted // 4  # an unrelated draft gets ~0


def test_draft_with_wider_vocabulary():
    target = tiny_gemma3(seed=0, vocab_size=262)
    wide = resized_vocab(target, TINY_VOCAB)
    reference = greedy_reference(target, LONG_PROMPT, 32)
    tokens, stats = run(Engine(target, ModelDrafter(wide, 262)), LONG_PROMPT, 3, 32)
    assert tokens == reference
    assert stats.accepted > stats.drafted // 4  # an unrelated draft gets ~0


def test_grouped_query_attention_and_other_window(tiny_draft):
    target = tiny_gemma3(seed=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, sliding_window_pattern=3, num_hidden_layers=6)
    draft = perturbed_copy(target, noise=0.02, seed=4)
    reference = greedy_reference(target, LONG_PROMPT, 40)
    for gamma in (2, 5):
        tokens, _ = run(Engine(target, ModelDrafter(draft, TINY_VOCAB)), LONG_PROMPT, gamma, 40)
        assert tokens == reference
