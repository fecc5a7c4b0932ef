"""DSpark (Gemma 4): tiny random drafts built by mlx-vlm's own `Gemma4DSparkDraftModel` in
DeepSpec's native packaging, for a tiny Gemma 4 target.

- draft parity with K ≠ V: with the value norm off, our block's tokens (Markov head
  included) and base logits are mlx-vlm's drafter's;
- where mlx-vlm is wrong: with the value norm on (as Gemma 4's attention and vLLM's
  Gemma4DSparkModel apply it) our logits are mlx-vlm's class with its values normed, not
  mlx-vlm's own; with K = V (no v_proj, the released layout) mlx-vlm's drafter raises, and
  ours equals its class taken through its per-layer K = V path with values normed;
- greedy output is mlx-lm's plain decoding (K = V), alone and batched; chi-square at T = 1
  with the Markov head conditioning each q on the token drawn before it, and a broken
  rule fails the check; a draft that does not fit is refused in one line;
- the confidence head: its estimates are mlx-vlm's `confidence` for the same block; a
  block is cut at the first position below the threshold (DeepSpec's prefix policy), which
  drafts fewer tokens where confidence is low and none when it is nil, while greedy output
  stays plain decoding's and T = 1 sampling the target's distribution (chi-square).
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters import load_drafter
from mlx_vlm.speculative.drafters.gemma4_dspark.gemma4_dspark import Gemma4DSparkAttention

import mlx_spec.core.verify as verify_module
from batch_support import batched
from conftest import greedy_reference
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, recovered_from_p, sampled_joint
from mlx_spec.apps.runner import build_engine
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import LogitProcessor, SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.block import BlockPass
from mlx_spec.drafters.dspark import DSparkDrafter
from mlx_spec.errors import IncompatibleModelsError
from mlx_spec.loading import load_pair
from mlx_spec.models import dspark
from mlx_spec.testing.tiny_block_drafts import reference_dspark, save_tiny_dspark, tiny_dspark_config
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4, tiny_gemma4

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]
MAX_TOKENS = 40
PROPOSAL = 7


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    save_tiny_gemma4(root / "target")
    save_tiny_dspark(root / "dspark", tiny_dspark_config(proposal=PROPOSAL))
    save_tiny_dspark(root / "k_eq_v", tiny_dspark_config(proposal=PROPOSAL, k_eq_v=True))
    save_tiny_dspark(root / "masked_anchor", tiny_dspark_config(proposal=PROPOSAL, sample_from_anchor=False))
    return root


@pytest.fixture(scope="module")
def pairs(folders):
    return {name: load_pair(str(folders / "target"), str(folders / name), dtype="float32", progress=False)
            for name in ("dspark", "k_eq_v", "masked_anchor")}


def reset(reference, target):
    """mlx-vlm's draft cache for `target`. Its bind checks the target is one of mlx-vlm's own
    (rollback support), which ours is not; the draft's math never reads the target (its
    embedding and head are its own), so that check is skipped."""
    reference.validate_target_compatibility = lambda target: None
    return reference.reset(target)


def started(pair, prompt, v_norm=True):
    """Our drafter after the prompt's prefill, and the prefill's taps; no confidence cut
    (mlx-vlm never cuts a block)."""
    drafter = build_engine(pair).drafter
    drafter.threshold = 0.0
    for layer in drafter.model.layers:
        layer.self_attn.v_norm = v_norm
    cache = Engine(pair.target.model, drafter).make_prompt_cache()
    cache.target.prefill(prompt[:-1], hidden=drafter.tap_layers)
    drafter.begin(prompt, cache, LogitProcessor(SamplingParams()))
    return drafter, cache.target.prefill_hidden


def reference_logits(reference, pair, prompt, taps):
    """mlx-vlm's base logits [P, V] for the block after `prompt` (its `draft_block` math)."""
    cache = reset(reference, pair.target.model)
    block = mx.array([[prompt[-1]] + [3] * (PROPOSAL - 1)])
    return reference._logits(reference._hidden(block, taps, cache))[0]


def normed_values(monkeypatch):
    """mlx-vlm's DSpark attention with its values through a scale-free RMS norm per head
    (Gemma 4's v_norm), the context path taken layer by layer (the fused one needs v_proj)."""
    real = Gemma4DSparkAttention._project_kv

    def project(self, x):
        keys, values = real(self, x)
        shape = values.shape
        values = mx.fast.rms_norm(values.reshape(*shape[:-1], self.n_kv_heads, -1), None, 1e-6).reshape(shape)
        return keys, values

    monkeypatch.setattr(Gemma4DSparkAttention, "_project_kv", project)


def test_the_folders_are_detected(folders, pairs):
    reference, _ = load_drafter(str(folders / "dspark"))
    assert type(reference).__name__ == "Gemma4DSparkDraftModel"
    for pair in pairs.values():
        drafter = build_engine(pair).drafter
        assert isinstance(drafter, DSparkDrafter) and drafter.tap_layers == (1, 3, 5)
    assert not hasattr(pairs["k_eq_v"].draft.model.layers[0].self_attn, "v_proj")


@pytest.mark.parametrize("name", ["dspark", "masked_anchor"])
@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_draft_parity_with_mlx_vlm_where_k_differs_from_v(folders, pairs, prompt, name):
    """Also with `sample_from_anchor: false` (the anchor's row dropped, one more mask)."""
    pair = pairs[name]
    reference, _ = load_drafter(str(folders / name))
    drafter, taps = started(pair, prompt, v_norm=False)
    argmax = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    expected = reference.draft_block(prompt[-1], taps, reset(reference, pair.target.model), PROPOSAL + 1, argmax)
    assert drafter.propose(PROPOSAL, prompt).tokens.tolist() == expected[0].tolist()
    step = BlockPass(drafter, prompt[-1])
    step.run()
    logits, _ = step.logits
    assert logits.shape[0] == PROPOSAL
    if name == "dspark":
        assert mx.allclose(logits, reference_logits(reference, pair, prompt, taps), atol=1e-4).item()


def test_values_are_normed_as_vllm_and_gemma4_norm_them(folders, pairs, monkeypatch):
    pair = pairs["dspark"]
    reference, _ = load_drafter(str(folders / "dspark"))
    drafter, taps = started(pair, SHORT_PROMPT)
    step = BlockPass(drafter, SHORT_PROMPT[-1])
    step.run()
    logits, _ = step.logits
    mlx_vlm_own = reference_logits(reference, pair, SHORT_PROMPT, taps)
    monkeypatch.setattr(type(reference), "_project_context_kv", lambda self, hidden: None)
    normed_values(monkeypatch)
    assert mx.allclose(logits, reference_logits(reference, pair, SHORT_PROMPT, taps), atol=1e-4).item()
    assert not mx.allclose(logits, mlx_vlm_own, atol=1e-2).item()


def test_k_equal_v_drafts_where_mlx_vlm_crashes(folders, pairs, monkeypatch):
    pair = pairs["k_eq_v"]
    reference, _ = load_drafter(str(folders / "k_eq_v"))
    drafter, taps = started(pair, SHORT_PROMPT)
    argmax = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    with pytest.raises(AttributeError, match="v_proj"):
        reference.draft_block(SHORT_PROMPT[-1], taps, reset(reference, pair.target.model), PROPOSAL + 1, argmax)
    monkeypatch.setattr(type(reference), "_project_context_kv", lambda self, hidden: None)
    normed_values(monkeypatch)
    expected = reference.draft_block(SHORT_PROMPT[-1], taps, reset(reference, pair.target.model), PROPOSAL + 1,
                                     argmax)
    assert drafter.propose(PROPOSAL, SHORT_PROMPT).tokens.tolist() == expected[0].tolist()


def run(engine, prompt, gamma, max_tokens=MAX_TOKENS, **kwargs):
    stats = Stats()
    tokens = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats, **kwargs)
              for t in r.tokens]
    return tokens, stats


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("gamma", [1, 3, PROPOSAL])
def test_greedy_matches_plain_decoding(pairs, prompt, gamma):
    pair = pairs["k_eq_v"]
    tokens, stats = run(build_engine(pair), prompt, gamma)
    assert tokens == greedy_reference(pair.target.model, prompt, MAX_TOKENS)
    assert stats.drafted > 0


def test_batched_rows_match_plain_decoding(pairs):
    pair = pairs["k_eq_v"]
    engine = build_engine(pair)
    requests = [engine.for_request().rounds(prompt, gamma=gamma, max_tokens=MAX_TOKENS, batched=True)
                for prompt, gamma in ((SHORT_PROMPT, 3), (LONG_PROMPT, 5))]
    out = {rounds: [] for rounds in requests}
    batched(requests, [0, 0], out)
    for rounds, prompt in zip(requests, (SHORT_PROMPT, LONG_PROMPT)):
        assert out[rounds] == greedy_reference(pair.target.model, prompt, MAX_TOKENS)


@pytest.fixture(scope="module")
def small():
    """A target over 8 tokens and a K = V DSpark draft for it (mlx-vlm's weights, less v_proj)."""
    target = tiny_gemma4(seed=2, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, logit_scale=0.5)
    config = tiny_dspark_config(target.config, proposal=3, k_eq_v=True)
    weights = dict(tree_flatten(reference_dspark({**config, "attention_k_eq_v": False}, seed=4).parameters()))
    draft = dspark.Model(dspark.ModelArgs.from_dict(config))
    draft.load_weights([(k, v) for k, v in weights.items() if ".v_proj." not in k])
    return target, draft


DRAWS = 1000
BROKEN_DRAWS = 500
GAMMA = 2


def test_sampling_matches_target_distribution(small):
    target, draft = small
    params = SamplingParams(**PARAMS)
    engine = Engine(target, DSparkDrafter(draft, target, confidence_threshold=0.0))
    stats = Stats()
    list(engine.rounds([2, 5, 3, 5, 1], params, gamma=GAMMA, max_tokens=3, stats=stats))
    assert stats.drafted > 0
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, DRAWS), exact_joint(target, params))
    assert stat < critical


def test_the_check_catches_a_broken_rule(small, monkeypatch):
    target, draft = small
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", recovered_from_p)
    engine = Engine(target, DSparkDrafter(draft, target, confidence_threshold=0.0))
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, BROKEN_DRAWS), exact_joint(target, params))
    assert stat > critical


def confidences(reference, pair, prompt, taps, tokens):
    """mlx-vlm's confidence estimates [P] for the block after `prompt` that drew `tokens`."""
    block = mx.array([[prompt[-1]] + [3] * (PROPOSAL - 1)])
    hidden = reference._hidden(block, taps, reset(reference, pair.target.model))
    return reference.confidence(hidden, mx.array([prompt[-1]]), mx.array([tokens]))[0]


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_the_confidence_cut_stops_at_the_first_position_below_the_threshold(folders, pairs, prompt):
    pair = pairs["dspark"]
    reference, _ = load_drafter(str(folders / "dspark"))
    drafter, taps = started(pair, prompt, v_norm=False)
    whole = drafter.propose(PROPOSAL, prompt).tokens.tolist()
    estimates = confidences(reference, pair, prompt, taps, whole).tolist()
    step = BlockPass(drafter, prompt[-1])
    step.run()
    ours = drafter.model.confidence(step.logits[1], mx.array([prompt[-1]] + whole[:-1]))
    assert mx.allclose(ours, mx.array(estimates), atol=1e-5).item()
    lowest = 1 + estimates[1:].index(min(estimates[1:]))  # a cut inside the block
    drafter.threshold = estimates[lowest] + 1e-6
    kept = next(j for j, c in enumerate(estimates) if c < drafter.threshold)
    assert kept <= lowest < PROPOSAL
    assert drafter.propose(PROPOSAL, prompt).tokens.tolist() == whole[:kept]


@pytest.mark.parametrize("bias, drafts", [(-20.0, "none"), (20.0, "all")])
def test_greedy_output_is_plain_decoding_whatever_the_cut(pairs, monkeypatch, bias, drafts):
    """Confidence nil everywhere: every block is cut before its first token; certain: never."""
    pair = pairs["k_eq_v"]
    monkeypatch.setenv("MLX_SPEC_DSPARK_CONFIDENCE", "0.5")
    engine = build_engine(pair)
    head = engine.drafter.model.confidence_head.proj
    # Set and restored by hand: the pair is shared by the module, and pytest 9.2's monkeypatch
    # undoes an attribute missing from `__dict__` by deleting it, which for an mlx Module's
    # parameter (kept in the Module's own dict) removes the bias for every later test.
    real_bias = head.bias
    head.bias = mx.full(real_bias.shape, bias)
    try:
        assert engine.drafter.threshold == 0.5
        tokens, stats = run(engine, LONG_PROMPT, PROPOSAL)
    finally:
        head.bias = real_bias
    assert tokens == greedy_reference(pair.target.model, LONG_PROMPT, MAX_TOKENS)
    engine.drafter.threshold = 0.0
    _, uncut = run(engine, LONG_PROMPT, PROPOSAL)
    assert stats.drafted == (0 if drafts == "none" else uncut.drafted) and uncut.drafted > 0


CUT = 0.52  # cuts about a quarter of this draft's tokens at γ = 2


def test_sampling_with_the_cut_matches_target_distribution(small):
    target, draft = small
    params = SamplingParams(**PARAMS)
    drafted = {}
    for threshold in (0.0, CUT):
        engine = Engine(target, DSparkDrafter(draft, target, confidence_threshold=threshold))
        stats = Stats()
        for seed in range(20):
            list(engine.rounds([2, 5, 3, 5, 1], SamplingParams(**{**PARAMS, "seed": seed}), gamma=GAMMA,
                               max_tokens=3, stats=stats))
        drafted[threshold] = stats.drafted
    assert 0 < drafted[CUT] < drafted[0.0]
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, DRAWS), exact_joint(target, params))
    assert stat < critical


def test_a_draft_that_does_not_fit_is_refused_in_one_line(folders):
    save_tiny_dspark(folders / "wrong", tiny_dspark_config(taps=(1, 3, 7), num_target_layers=8))
    with pytest.raises(IncompatibleModelsError, match="no layer 7") as error:
        load_pair(str(folders / "target"), str(folders / "wrong"), progress=False)
    assert "\n" not in str(error.value)
