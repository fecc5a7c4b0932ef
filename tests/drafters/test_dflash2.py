"""DFlash 2: a tiny random draft built by mlx-vlm's own `DFlash2DraftModel` (base kernels
drawn at random, the codebooks written without `.weight` as released), for the tiny
Gemma 4 target, loaded by our loader and paired.

- draft parity: given the same target states and tokens, our block's logits are mlx-vlm's
  bit for bit and its tokens (the candidate selector's path) are mlx-vlm's `draft_block`,
  inside and past the sliding window, and the selector changes the tokens the base logits
  alone would give;
- greedy output is mlx-lm's plain `generate_step`, alone and batched, and the target's own
  constrained decoding under a JSON-schema grammar;
- at T = 1 the first two tokens fit the target's exact joint (chi-square), q being zero
  outside each position's candidates; a draft that does not fit is refused in one line.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters import load_drafter

from batch_support import batched
from conftest import greedy_reference
from grammar_support import drafted_under_the_address_schema
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, sampled_joint
from mlx_spec.apps.runner import build_engine
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import LogitProcessor, SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.block import BlockPass
from mlx_spec.drafters.dflash2 import DFlash2Drafter
from mlx_spec.errors import IncompatibleModelsError
from mlx_spec.loading import load_pair
from mlx_spec.models import dflash2
from mlx_spec.models.drafts import draft_facts
from mlx_spec.testing.tiny_block_drafts import reference_dflash2, save_tiny_dflash2, tiny_dflash2_config
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4, tiny_gemma4

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]
MAX_TOKENS = 40
BLOCK = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    save_tiny_gemma4(root / "target")
    save_tiny_dflash2(root / "dflash2", tiny_dflash2_config(block_size=BLOCK))
    return root


@pytest.fixture(scope="module")
def pair(folders):
    return load_pair(str(folders / "target"), str(folders / "dflash2"), dtype="float32", progress=False)


def test_the_folder_is_detected_and_mlx_vlm_loads_it_too(folders, pair):
    reference, kind = load_drafter(str(folders / "dflash2"))
    assert kind == "dflash" and type(reference).__name__ == "DFlash2DraftModel"
    drafter = build_engine(pair).drafter
    assert isinstance(drafter, DFlash2Drafter) and drafter.tap_layers == (1, 3, 5)
    assert draft_facts(pair.draft.config) == {"family": "dflash2", "block_size": BLOCK, "tap_layers": [1, 3, 5],
                                              "selector_top_k": 6, "conv_kernel_size": 2}


def started(pair, prompt):
    drafter = build_engine(pair).drafter
    cache = Engine(pair.target.model, drafter).make_prompt_cache()
    cache.target.prefill(prompt[:-1], hidden=drafter.tap_layers)
    drafter.begin(prompt, cache, LogitProcessor(SamplingParams()))
    return drafter, cache.target.prefill_hidden


def reset(reference, target):
    """mlx-vlm's draft cache, bound to `target` (its check that the target is one of
    mlx-vlm's own models skipped: ours is mlx-lm's)."""
    reference.validate_target_compatibility = lambda target: None
    return reference.reset(target)


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_draft_parity_with_mlx_vlm_bit_for_bit(folders, pair, prompt):
    reference, _ = load_drafter(str(folders / "dflash2"))
    drafter, taps = started(pair, prompt)
    argmax = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    expected = reference.draft_block(prompt[-1], taps, reset(reference, pair.target.model), BLOCK, argmax)
    tokens = drafter.propose(BLOCK - 1, prompt).tokens.tolist()
    assert tokens == expected[0].tolist()
    step = BlockPass(drafter, prompt[-1])
    step.run()
    logits, _ = step.logits
    block = mx.array([[prompt[-1]] + [pair.draft.model.args.mask_token_id] * (BLOCK - 1)])
    hidden = reference._hidden(block, taps, reset(reference, pair.target.model))[:, 1:]
    assert mx.array_equal(logits, reference._logits(hidden)[0]).item()
    if prompt is SHORT_PROMPT:  # the selector's lattice, not the logits alone, picked the path
        assert tokens != mx.argmax(logits, axis=-1).tolist()


def run(engine, prompt, gamma):
    stats = Stats()
    tokens = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=MAX_TOKENS, stats=stats) for t in r.tokens]
    return tokens, stats


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("gamma", [1, 3, BLOCK - 1])
def test_greedy_matches_plain_decoding(pair, prompt, gamma):
    tokens, stats = run(build_engine(pair), prompt, gamma)
    assert tokens == greedy_reference(pair.target.model, prompt, MAX_TOKENS)
    assert stats.drafted > 0


def test_batched_rows_match_plain_decoding(pair):
    engine = build_engine(pair)
    requests = [engine.for_request().rounds(prompt, gamma=gamma, max_tokens=MAX_TOKENS, batched=True)
                for prompt, gamma in ((SHORT_PROMPT, 3), (LONG_PROMPT, 5))]
    out = {rounds: [] for rounds in requests}
    batched(requests, [0, 0], out)
    for rounds, prompt in zip(requests, (SHORT_PROMPT, LONG_PROMPT)):
        assert out[rounds] == greedy_reference(pair.target.model, prompt, MAX_TOKENS)


def test_greedy_under_a_grammar_matches_constrained_decoding(pair):
    tokens, reference, drafted = drafted_under_the_address_schema(pair.target.model, build_engine(pair).drafter)
    assert tokens == reference and drafted > 0


DRAWS = 1000
GAMMA = 2


@pytest.fixture(scope="module")
def small():
    """A target over 8 tokens and a DFlash 2 draft for it choosing among 3 candidates."""
    target = tiny_gemma4(seed=2, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, logit_scale=0.5)
    config = tiny_dflash2_config(target.config, block_size=GAMMA + 1)
    config["dflash_config"]["selector_top_k"] = 3
    draft = dflash2.Model(dflash2.ModelArgs.from_dict(config))
    draft.load_weights(tree_flatten(reference_dflash2(config, seed=4).parameters()))
    return target, draft


def test_sampling_matches_target_distribution(small):
    target, draft = small
    params = SamplingParams(**PARAMS)
    engine = Engine(target, DFlash2Drafter(draft, target))
    stats = Stats()
    list(engine.rounds([2, 5, 3, 5, 1], params, gamma=GAMMA, max_tokens=3, stats=stats))
    assert stats.drafted > 0
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, DRAWS), exact_joint(target, params))
    assert stat < critical


def test_a_draft_that_does_not_fit_is_refused_in_one_line(folders):
    save_tiny_dflash2(folders / "wrong", tiny_dflash2_config(taps=(1, 3, 7), num_target_layers=8))
    with pytest.raises(IncompatibleModelsError, match="no layer 7") as error:
        load_pair(str(folders / "target"), str(folders / "wrong"), progress=False)
    assert "\n" not in str(error.value) and "DFlash 2" in str(error.value)
