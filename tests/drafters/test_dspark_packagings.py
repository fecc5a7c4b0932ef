"""DSpark in the two other packagings, for the tiny Gemma 4 target:

- SpecForge (`dflash_config.projector_type: "dspark"`, a Qwen 3 backbone with the target's
  embedding and head): mlx-vlm's loader loads the folder as its `DSparkDraftModel`, and our
  block's tokens (Markov head included) and base logits are that class's, inside and past
  the sliding window;
- vLLM speculators (`speculators_config.algorithm: "dspark"`, a Gemma 4
  `transformer_layer_config`, aux ids one past the tapped layers, the anchor a bonus token, a
  reduced vocabulary with `d2t`): mlx-vlm 0.7.10 cannot load it; our tokens follow vLLM's
  math (base logits and Markov bias in the draft vocabulary, the argmax mapped through d2t):
  mlx-vlm's Gemma 4 class over the whole vocabulary with every id outside the draft
  vocabulary masked, the same weights;
- greedy output is mlx-lm's plain decoding for both (speculators: K = V, a draft vocabulary
  that lacks most of what the target emits), and under a JSON-schema grammar the target's
  own constrained decoding; chi-square at T = 1 with q mapped through d2t
  (zero outside the draft vocabulary); a draft that does not fit is refused in one line.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters import load_drafter

from conftest import greedy_reference
from grammar_support import drafted_under_the_address_schema
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, sampled_joint
from mlx_spec.apps.runner import build_engine
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import LogitProcessor, SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.block import BlockPass
from mlx_spec.drafters.dspark import DSparkDrafter
from mlx_spec.errors import IncompatibleModelsError
from mlx_spec.loading import load_pair
from mlx_spec.models import dspark
from mlx_spec.models.drafts import draft_facts, draft_family
from mlx_spec.testing.tiny_block_drafts import (draft_vocabulary, reference_dspark, save_tiny_specforge_dspark,
                                                save_tiny_speculators_dspark, speculators_as_native,
                                                tiny_specforge_dspark_config, tiny_speculators_dspark_config)
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4, tiny_gemma4

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]
MAX_TOKENS = 40
PROPOSAL = 7
DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_packagings")
    save_tiny_gemma4(root / "target")
    save_tiny_specforge_dspark(root / "specforge", tiny_specforge_dspark_config(proposal=PROPOSAL))
    for name, k_eq_v in (("speculators", False), ("speculators_k_eq_v", True)):
        save_tiny_speculators_dspark(root / name, tiny_speculators_dspark_config(
            rows=PROPOSAL + 1, draft_vocab=DRAFT_VOCAB, k_eq_v=k_eq_v))
    return root


@pytest.fixture(scope="module")
def pairs(folders):
    return {name: load_pair(str(folders / "target"), str(folders / name), dtype="float32", progress=False)
            for name in ("specforge", "speculators", "speculators_k_eq_v")}


def started(pair, prompt, v_norm=True):
    """Our drafter after the prompt's prefill (no confidence cut: mlx-vlm never cuts), and
    the prefill's taps."""
    drafter = build_engine(pair).drafter
    drafter.threshold = 0.0
    for layer in drafter.model.layers:
        if hasattr(layer.self_attn, "v_norm"):
            layer.self_attn.v_norm = v_norm
    cache = Engine(pair.target.model, drafter).make_prompt_cache()
    cache.target.prefill(prompt[:-1], hidden=drafter.tap_layers)
    drafter.begin(prompt, cache, LogitProcessor(SamplingParams()))
    return drafter, cache.target.prefill_hidden


def reset(reference, target):
    """mlx-vlm's draft cache, bound to `target` (its check that the target is one of
    mlx-vlm's own models skipped: ours is mlx-lm's)."""
    reference.validate_target_compatibility = lambda target: None
    return reference.reset(target)


def test_the_packagings_are_detected(folders, pairs):
    reference, kind = load_drafter(str(folders / "specforge"))
    assert kind == "dflash" and type(reference).__name__ == "DSparkDraftModel"
    with pytest.raises(TypeError, match="dflash_config"):  # mlx-vlm reads no speculators DSpark
        load_drafter(str(folders / "speculators"))
    for name, pair in pairs.items():
        assert draft_family(pair.draft.config) == "dspark"
        drafter = build_engine(pair).drafter
        assert isinstance(drafter, DSparkDrafter) and drafter.tap_layers == (1, 3, 5)
        assert drafter.model.block_size == PROPOSAL + 1
    sf, sp = (draft_facts(pairs[n].draft.config) for n in ("specforge", "speculators_k_eq_v"))
    assert (sf["packaging"], sf["backbone"], sf["draft_vocab"]) == ("specforge", "qwen3", None)
    assert (sp["packaging"], sp["backbone"], sp["draft_vocab"], sp["k_eq_v"]) == ("speculators", "gemma4",
                                                                                   DRAFT_VOCAB, True)
    assert not pairs["speculators"].draft.model.args.sample_from_anchor  # vLLM's bonus anchor


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_specforge_draft_parity_with_mlx_vlm(folders, pairs, prompt):
    pair = pairs["specforge"]
    reference, _ = load_drafter(str(folders / "specforge"))
    drafter, taps = started(pair, prompt)
    argmax = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    cache = reset(reference, pair.target.model)
    expected = reference.draft_block(prompt[-1], taps, cache, PROPOSAL + 1, argmax)
    assert drafter.propose(PROPOSAL, prompt).tokens.tolist() == expected[0].tolist()
    step = BlockPass(drafter, prompt[-1])
    step.run()
    logits, rows = step.logits
    block = mx.array([[prompt[-1]] + [3] * (PROPOSAL - 1)])
    hidden = reference._hidden(block, taps, reset(reference, pair.target.model))
    assert mx.allclose(logits, reference._logits(hidden)[0], atol=1e-4).item()
    # the confidence head reads the rows mlx-vlm's would
    confidence = drafter.model.confidence(rows, mx.concatenate([mx.array([prompt[-1]]), expected[0, :-1]]))
    assert mx.allclose(confidence, reference.confidence(hidden, mx.array([prompt[-1]]), expected)[0],
                       atol=1e-5).item()


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_speculators_draft_follows_vllms_reduced_vocabulary_math(pairs, prompt):
    pair = pairs["speculators"]
    config = pair.draft.config
    vocab_ids = draft_vocabulary(DRAFT_VOCAB, config["transformer_layer_config"]["vocab_size"])
    reference = reference_dspark(speculators_as_native(config))  # the same weights, whole vocabulary
    drafter, taps = started(pair, prompt, v_norm=False)  # mlx-vlm's class norms no values
    outside = mx.ones((config["transformer_layer_config"]["vocab_size"],), mx.bool_)
    outside[mx.array(vocab_ids)] = False
    in_vocabulary = lambda logits: mx.argmax(mx.where(outside, -mx.inf, logits), axis=-1)  # noqa: E731
    expected = reference.draft_block(prompt[-1], taps, reset(reference, pair.target.model), PROPOSAL + 1,
                                     in_vocabulary)
    tokens = drafter.propose(PROPOSAL, prompt).tokens.tolist()
    assert tokens == expected[0].tolist() and set(tokens) <= set(vocab_ids)


@pytest.mark.parametrize("name", ["specforge", "speculators_k_eq_v"])
@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("gamma", [1, 3, PROPOSAL])
def test_greedy_matches_plain_decoding(pairs, name, prompt, gamma):
    pair = pairs[name]
    stats = Stats()
    tokens = [t for r in build_engine(pair).rounds(prompt, gamma=gamma, max_tokens=MAX_TOKENS, stats=stats)
              for t in r.tokens]
    assert tokens == greedy_reference(pair.target.model, prompt, MAX_TOKENS)
    assert stats.drafted > 0


def test_greedy_under_a_grammar_matches_constrained_decoding(pairs):
    pair = pairs["speculators_k_eq_v"]
    tokens, reference, drafted = drafted_under_the_address_schema(pair.target.model, build_engine(pair).drafter)
    assert tokens == reference and drafted > 0


DRAWS = 1000
GAMMA = 2


@pytest.fixture(scope="module")
def small():
    """A target over 8 tokens and a speculators K = V DSpark draft for it over 5 of them."""
    target = tiny_gemma4(seed=2, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, logit_scale=0.5)
    config = tiny_speculators_dspark_config(target.config, rows=GAMMA + 2, draft_vocab=5)
    vocab_ids = [0, 2, 3, 5, 6]
    weights = dict(tree_flatten(reference_dspark(speculators_as_native(config), seed=4).parameters()))
    rows = mx.array(vocab_ids)
    for key in ("lm_head.weight", "markov_head.markov_w2.weight"):
        weights[key] = weights[key][rows]
    weights["d2t"] = rows - mx.arange(len(vocab_ids))
    draft = dspark.Model(dspark.ModelArgs.from_dict(config))
    draft.load_weights([(k, v) for k, v in weights.items() if ".v_proj." not in k])
    return target, draft


def test_sampling_with_a_reduced_vocabulary_matches_target_distribution(small):
    target, draft = small
    params = SamplingParams(**PARAMS)
    engine = Engine(target, DSparkDrafter(draft, target, confidence_threshold=0.0))
    stats = Stats()
    list(engine.rounds([2, 5, 3, 5, 1], params, gamma=GAMMA, max_tokens=3, stats=stats))
    assert stats.drafted > 0
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, DRAWS), exact_joint(target, params))
    assert stat < critical


def test_a_draft_that_does_not_fit_is_refused_in_one_line(folders):
    config = tiny_speculators_dspark_config(draft_vocab=DRAFT_VOCAB, aux_hidden_state_layer_ids=[2, 4, 9])
    save_tiny_speculators_dspark(folders / "wrong", config)
    with pytest.raises(IncompatibleModelsError, match="no layer 8") as error:
        load_pair(str(folders / "target"), str(folders / "wrong"), progress=False)
    assert "\n" not in str(error.value)
