"""Temperature 0: speculative output is token-identical to plain greedy decoding of the
target (mlx-lm's generate_step), for every γ and drafter, across the sliding window."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import greedy_reference
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_repetition_penalty

from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.testing.tiny import TINY_VOCAB, perturbed_copy, tiny_gemma3

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


PENALTY, PENALTY_CONTEXT = 1.5, 16


@pytest.fixture(scope="module")
def penalty_prompts(tiny_target):
    """A prompt shorter than the penalty context that starts with the token this model
    likes to repeat (a window that loses the oldest history token lets it through), and
    one longer than the context."""
    favourite = max(set(plain := greedy_reference(tiny_target, [2, 40, 41, 42], 20)), key=plain.count)
    return {"short": [favourite, 40, 41, 42, 43], "long": LONG_PROMPT}


@pytest.fixture(scope="module")
def penalized_references(tiny_target, penalty_prompts):
    """mlx-lm's own generate_step with its repetition-penalty processor (the history it
    penalizes includes the prompt, as ours does)."""
    processor = make_repetition_penalty(PENALTY, PENALTY_CONTEXT)
    return {
        name: [t for t, _ in generate_step(mx.array(prompt), tiny_target, max_tokens=40,
                                          logits_processors=[processor])]
        for name, prompt in penalty_prompts.items()
    }


@pytest.mark.parametrize("prompt_name", ["short", "long"])  # shorter / longer than the context
@pytest.mark.parametrize("gamma", [0, 1, 3])
@pytest.mark.parametrize("drafter_name", ["model", "ngram"])
def test_repetition_penalty_matches_mlx_lm(tiny_target, tiny_draft, penalty_prompts, penalized_references,
                                           prompt_name, gamma, drafter_name):
    prompt = penalty_prompts[prompt_name]
    assert (len(prompt) < PENALTY_CONTEXT) == (prompt_name == "short")
    drafter = ModelDrafter(tiny_draft, TINY_VOCAB) if drafter_name == "model" else NgramDrafter()
    params = SamplingParams(repetition_penalty=PENALTY, repetition_context=PENALTY_CONTEXT)
    tokens, _ = run(Engine(tiny_target, drafter), prompt, gamma, 40, params=params)
    assert tokens == penalized_references[prompt_name]
    assert tokens != greedy_reference(tiny_target, prompt, 40)  # the penalty changed the text


class RecordingModel:
    """Wraps a model and records the largest token id it was fed."""

    def __init__(self, model):
        self.model, self.largest = model, -1

    def __call__(self, inputs, cache=None, **kwargs):
        self.largest = max(self.largest, int(mx.max(inputs).item()))
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_ids_the_draft_lacks_never_reach_it(tiny_target, penalty):
    """The target emits ids past the draft's vocabulary (as a 262208-wide Gemma 3 12B can
    past a 262144-wide 270M): they must not index the draft's embedding (MLX does not
    bounds-check gathers; with a penalty the old code aborted the process), and output
    stays the target's."""
    width = 200
    params = SamplingParams(repetition_penalty=penalty, repetition_context=16)
    reference = run(Engine(tiny_target), LONG_PROMPT, 0, 40, params=params)[0]
    assert max(reference) >= width  # the target does emit ids the draft lacks
    draft = RecordingModel(resized_vocab(tiny_target, width))
    tokens, stats = run(Engine(tiny_target, ModelDrafter(draft, TINY_VOCAB)), LONG_PROMPT, 3, 40, params=params)
    assert tokens == reference
    assert 0 <= draft.largest < width
    assert stats.drafted > 0


class TieModel(nn.Module):
    """Logits that tie only once they are log-probs: after token t, id a = t mod 32 has
    logit 0 and id b = 32 + (5t mod 32) a logit a rounding step above it, the rest −10.
    Raw, b is the argmax; as logits − logsumexp (mlx-lm's greedy) the two are equal, and
    argmax takes the lower id, a."""

    vocab, step = 64, 2e-8

    def __init__(self):
        super().__init__()
        self.layers = [None]

    def make_cache(self):
        return [KVCache()]

    def row(self, t: int) -> list[float]:
        row = [-10.0] * self.vocab
        row[t % 32], row[32 + (5 * t) % 32] = 0.0, self.step
        return row

    def __call__(self, inputs, cache=None):
        ids = inputs.astype(mx.float32)[:, None, :, None]
        cache[0].update_and_fetch(ids, ids)  # the engine's rollback trims it
        return mx.array([[self.row(t) for t in inputs[0].tolist()]])


@pytest.mark.parametrize("gamma", [0, 3])
def test_greedy_breaks_ties_as_mlx_lm_does(gamma):
    model = TieModel()
    logits = mx.array(model.row(7))
    assert mx.argmax(logits).item() == 32 + 35 % 32  # raw: b
    assert mx.argmax(logits - mx.logsumexp(logits, keepdims=True)).item() == 7  # log-probs tie: a
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    reference = greedy_reference(model, prompt, 24)
    tokens, stats = run(Engine(model, NgramDrafter()), prompt, gamma, 24)
    assert tokens == reference == [2] * 24  # a = 2 mod 32 follows 2 every time
    assert gamma == 0 or stats.drafted > 0


def test_the_cheap_greedy_choice_is_exact_or_left_undecided():
    """On a CPU `greedy` skips the log-probs where no two can tie: every row it decides must
    be mlx-lm's token (the argmax of logits − logsumexp), and it may leave undecided only
    rows with a rival within `tie_step` of the top, which the exact pass then decides."""
    from mlx_spec.core.sampling import UNDECIDED, LogitProcessor, tie_step

    processor = LogitProcessor(SamplingParams())
    processor.exact_everywhere = False  # the CPU path, on any device
    V = 4096
    logits = mx.random.normal((64, V), key=mx.random.key(3)) * 3.0
    step = tie_step(logits.dtype, V)
    top = mx.argmax(logits, axis=-1)
    # rivals a fraction of a step below the top in half the rows, at a lower id than it
    rival = (top + V - 1) % V
    rows = mx.arange(64)
    near = mx.array(logits)
    near[rows[::2], rival[::2]] = logits[rows[::2], top[::2]] - mx.array([0.0, 0.25, 0.5, 0.9] * 8) * step
    exact = mx.argmax(near - mx.logsumexp(near, axis=-1, keepdims=True), axis=-1)
    cheap = processor.greedy(near)
    assert (processor.greedy(near, settle=True) == exact).all().item()
    decided = cheap != UNDECIDED
    assert (mx.where(decided, cheap == exact, True)).all().item()
    assert decided[1::2].all().item()  # no rival close: decided at once
    assert not decided[::2].any().item()  # a rival within the step: left to the exact pass
