"""DFlash: a tiny random draft built and written by mlx-vlm's own `DFlashDraftModel` in
z-lab's packaging, for a tiny Gemma 4 target, loaded by our loader and paired.

- the tap layers come out of the target's own forward (the last one, normed, is the
  final hidden state mlx-lm's decoder returns), batched rows as alone;
- draft parity: given the same target states and tokens, our block's logits and tokens
  are mlx-vlm's drafter's (its `draft_block`), over two rounds, inside and past the window;
- greedy output is mlx-lm's plain `generate_step`, alone, batched and under a grammar;
- at T = 1 the first two tokens fit the target's exact joint (chi-square), and the same
  check fails a broken acceptance rule;
- a draft that does not fit the target is refused in one line; the cost model prices the
  block per forward.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters import load_drafter

import mlx_spec.core.verify as verify_module
from conftest import chat_turn_matches_plain_decoding, greedy_reference
from mlx_spec.core.batch import Batch
from mlx_spec.core.cache.forward import final_hidden, forward_model
from mlx_spec.core.cache.sequence import SequenceCache
from mlx_spec.core.cost_model import CostCurve
from mlx_spec.apps.calibration import measure_costs
from mlx_spec.apps.conversation import ChatSession
from mlx_spec.drafters.block import BlockPass
from mlx_spec.drafters.dflash import DFlashDrafter
from mlx_spec.core.engine import Engine
from mlx_spec.errors import IncompatibleModelsError
from mlx_spec.core.grammar import compile_grammar
from mlx_spec.loading import load_pair
from mlx_spec.models import dflash
from mlx_spec.core.passes import TargetPass, run_passes
from mlx_spec.apps.runner import build_engine, gamma_policy
from mlx_spec.core.sampling import LogitProcessor, SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.testing.tiny_block_drafts import reference_dflash, save_tiny_dflash, tiny_dflash_config
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4, tiny_gemma4
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, recovered_from_p, sampled_joint
from grammar_support import ADDRESS, EOS, TOKENIZER, constrained_reference
from grammar_support import PROMPT as ADDRESS_PROMPT

pytest_plugins = ["cli_fixtures"]  # private_cost_cache

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]  # shorter than the window
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]  # longer than the window
MAX_TOKENS = 40  # every generation crosses the window
BLOCK = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    save_tiny_gemma4(root / "target")
    save_tiny_dflash(root / "dflash", tiny_dflash_config(block_size=BLOCK))
    return root


@pytest.fixture(scope="module")
def pair(folders):
    return load_pair(str(folders / "target"), str(folders / "dflash"), dtype="float32", progress=False)


def run(engine, prompt, gamma, max_tokens=MAX_TOKENS, **kwargs):
    stats = Stats()
    rounds = list(engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats, **kwargs))
    stats.drafting_rounds = sum(r.gamma > 0 for r in rounds)
    return [t for r in rounds for t in r.tokens], stats


def test_the_folder_is_detected_and_mlx_vlm_loads_it_too(folders, pair):
    reference, kind = load_drafter(str(folders / "dflash"))
    assert kind == "dflash" and type(reference).__name__ == "DFlashDraftModel"
    engine = build_engine(pair)  # no --drafter: the checkpoint's config decides
    assert isinstance(engine.drafter, DFlashDrafter)
    assert engine.wants_hidden == (1, 3, 5) and pair.draft.tokenizer is None
    assert engine.drafter.model.block_size == BLOCK


def test_taps_come_out_of_the_targets_own_forward(pair):
    """The last layer's tap, through the final norm, is mlx-lm's decoder output; the logits
    are the model's own; a batch's rows get what each row gets alone."""
    model = pair.target.model
    ids = mx.array([[2, 40, 41, 42, 43, 44]])
    logits, taps = forward_model(model, ids, None, hidden=(0, 5))
    assert taps.shape == (1, 6, 2 * 64)
    assert mx.allclose(logits, model(ids), atol=1e-5).item()
    assert mx.allclose(model.model.norm(taps[..., 64:]), final_hidden(model, ids, None), atol=1e-5).item()
    rows = []
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        cache = SequenceCache(model, slack=8)
        cache.prefill(prompt[:-1])
        rows.append(cache)
    passes = [TargetPass(c, mx.array([7, 8, 9]), (1, 3, 5)) for c in rows]
    run_passes(passes)
    for cache, p, prompt in zip(rows, passes, (SHORT_PROMPT, LONG_PROMPT)):
        _, alone = forward_model(model, mx.array([prompt[:-1] + [7, 8, 9]]), None, hidden=(1, 3, 5))
        assert mx.allclose(p.hidden_states, alone[0, -3:], atol=1e-4).item()


def test_prefill_keeps_every_fed_positions_taps(pair):
    cache = SequenceCache(pair.target.model, slack=8)
    cache.prefill(LONG_PROMPT[:30], chunk_size=7, hidden=(1, 3, 5))
    _, whole = forward_model(pair.target.model, mx.array([LONG_PROMPT[:30]]), None, hidden=(1, 3, 5))
    assert cache.prefill_hidden.shape == (1, 30, 192)
    assert mx.allclose(cache.prefill_hidden, whole, atol=1e-4).item()


def our_drafter(pair, prompt):
    drafter = build_engine(pair).drafter
    cache = Engine(pair.target.model, drafter).make_prompt_cache()
    cache.target.prefill(prompt[:-1], hidden=drafter.tap_layers)
    taps = cache.target.prefill_hidden
    drafter.begin(prompt, cache, LogitProcessor(SamplingParams()))
    return drafter, taps


@pytest.mark.parametrize("prompt, more", [(SHORT_PROMPT, 3), (LONG_PROMPT, 1)])
def test_draft_parity_with_mlx_vlm(folders, pair, prompt, more):
    """Round 1 from the prompt's states, round 2 after `more` committed positions: our
    block's logits and tokens are those of mlx-vlm's drafter fed the same states. (Past the
    window mlx-vlm's rotating cache shows a block window − 2 + n context keys after n new
    ones; ours always window − 1, so past the window the rounds compare at n = 1.)"""
    reference, _ = load_drafter(str(folders / "dflash"))
    ref_cache = reference.reset(pair.target.model)
    drafter, taps = our_drafter(pair, prompt)
    argmax = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    last = prompt[-1]
    for round_ in range(2):
        expected = reference.draft_block(last, taps, ref_cache, BLOCK, argmax)[0]
        ours = drafter.propose(BLOCK - 1, prompt)
        assert ours.tokens.tolist() == expected.tolist() and ours.forwards == 1
        assert drafter.propose(3, prompt).tokens.tolist() == expected[:3].tolist()  # γ only cuts the block
        # the states the next round adds: any [more + 1, k·H] rows, the first `more` kept
        taps = mx.random.normal((1, more + 1, 192), key=mx.random.key(round_))
        committed = [50 + i for i in range(more)]
        drafter.accept(committed, taps[0])
        taps, last = taps[:, :more], committed[-1]
    assert drafter.context.length == len(prompt) - 1 + 2 * more


def test_draft_logits_match_mlx_vlm(folders, pair):
    reference, _ = load_drafter(str(folders / "dflash"))
    drafter, taps = our_drafter(pair, SHORT_PROMPT)
    block = mx.array([[SHORT_PROMPT[-1]] + [3] * (BLOCK - 1)])
    expected = reference(block, taps, reference.reset(pair.target.model))[0, 1:]
    step = BlockPass(drafter, SHORT_PROMPT[-1])
    step.run()
    assert mx.allclose(step.logits, expected, atol=1e-4).item()


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("gamma", [1, 3, BLOCK - 1, 12])
def test_greedy_matches_plain_decoding(pair, prompt, gamma):
    tokens, stats = run(build_engine(pair), prompt, gamma)
    assert tokens == greedy_reference(pair.target.model, prompt, MAX_TOKENS)
    assert stats.drafted > 0 and stats.draft_forwards == stats.drafting_rounds  # one forward a round


@pytest.fixture(scope="module")
def small():
    """A target over 8 tokens and a DFlash draft for it (mlx-vlm's class, our copy of its
    weights): random drafts that the target often accepts."""
    target = tiny_gemma4(seed=2, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, logit_scale=0.5)
    config = tiny_dflash_config(target.config, block_size=4)
    draft = dflash.Model(dflash.ModelArgs.from_dict(config))
    draft.load_weights(list(tree_flatten(reference_dflash(config, seed=4).parameters())))
    return target, draft


def test_greedy_with_acceptances_matches_plain_decoding(small):
    target, draft = small
    for prompt in ([2, 5, 3, 5, 1], [2] + [(3 * i) % 6 + 1 for i in range(30)]):
        tokens, stats = run(Engine(target, DFlashDrafter(draft, target)), prompt, 3)
        assert tokens == greedy_reference(target, prompt, MAX_TOKENS)
        assert stats.accepted > 0


def test_batched_rows_match_plain_decoding_in_one_draft_forward(pair, monkeypatch):
    """Two requests in one batch: each answer is mlx-lm's greedy one and drafts what it
    drafts alone (its own context reached its block), and both blocks run in one forward."""
    engine = build_engine(pair)
    calls = []
    real = DFlashDrafter.block_logits
    monkeypatch.setattr(DFlashDrafter, "block_logits", lambda self, passes: calls.append(len(passes)) or real(self, passes))
    out, requests, alone = {}, [], []
    batch = Batch(out=lambda generator, r: out[generator].append((r.gamma, r.accepted, r.tokens)))
    for prompt, gamma in ((SHORT_PROMPT, 3), (LONG_PROMPT, 5)):
        rounds = engine.for_request().rounds(prompt, gamma=gamma, max_tokens=MAX_TOKENS, batched=True)
        out[rounds] = []
        requests.append(rounds)
        batch.add(rounds)
        alone.append([(r.gamma, r.accepted, r.tokens) for r in
                      engine.for_request().rounds(prompt, gamma=gamma, max_tokens=MAX_TOKENS)])
    del calls[:]
    while len(batch):
        batch.step()
    assert 2 in calls
    for rounds, prompt, own in zip(requests, (SHORT_PROMPT, LONG_PROMPT), alone):
        assert [t for _, _, tokens in out[rounds] for t in tokens] == greedy_reference(
            pair.target.model, prompt, MAX_TOKENS)
        assert out[rounds] == own


def test_greedy_under_a_grammar_matches_constrained_decoding(pair):
    engine = Engine(pair.target.model, build_engine(pair).drafter, eos_ids=EOS)
    grammar = compile_grammar(TOKENIZER, "json_schema", ADDRESS, EOS).matcher(EOS)
    tokens, stats = run(engine, ADDRESS_PROMPT, 5, max_tokens=60, constraint=grammar)
    assert [t for t in tokens if t not in EOS] == constrained_reference(pair.target.model, ADDRESS_PROMPT, ADDRESS, 60)
    assert stats.drafted > 0


DRAWS = 1000
BROKEN_DRAWS = 500
GAMMA = 2


def test_sampling_matches_target_distribution(small):
    target, draft = small
    params = SamplingParams(**PARAMS)
    engine = Engine(target, DFlashDrafter(draft, target))
    stats = Stats()
    list(engine.rounds([2, 5, 3, 5, 1], params, gamma=GAMMA, max_tokens=3, stats=stats))
    assert stats.drafted > 0  # round 1 drafts from the prefill's states
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, DRAWS), exact_joint(target, params))
    assert stat < critical


def test_the_check_catches_a_broken_rule(small, monkeypatch):
    target, draft = small
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", recovered_from_p)
    engine = Engine(target, DFlashDrafter(draft, target))
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, BROKEN_DRAWS), exact_joint(target, params))
    assert stat > critical


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=32), "hidden size 32; this target's is 64"),
    (dict(vocab_size=300), "vocabulary of 300"),
    (dict(dflash_config={"block_size": 8, "target_layer_ids": [1, 6], "mask_token_id": 3}), "no layer 6"),
])
def test_a_draft_that_does_not_fit_is_refused_in_one_line(folders, change, message):
    config = tiny_dflash_config(**change)
    if "hidden_size" in change:
        config["head_dim"] = 16
    save_tiny_dflash(folders / "wrong", config)
    with pytest.raises(IncompatibleModelsError, match=message) as error:
        load_pair(str(folders / "target"), str(folders / "wrong"), progress=False)
    assert "\n" not in str(error.value)


def test_the_cost_model_prices_a_block_per_forward(pair, private_cost_cache):
    curve = CostCurve([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], 0.5, 256, block=True)
    assert curve.round_time(7) == pytest.approx(0.5 + 1.7)
    assert CostCurve(curve.verify, 0.5, 256).round_time(7) == pytest.approx(7 * 0.5 + 1.7)
    measured = measure_costs(pair.target.model, pair.draft.model, max_width=3, context=64)
    assert 0 < measured.draft_step == measured.draft_step2
    policy = gamma_policy("auto", build_engine(pair), context=64)
    assert policy.calibrated.block
    assert policy.max_gamma == BLOCK - 1  # the whole block is weighed, not MAX_AUTO_GAMMA


def test_chat_turns_keep_the_whole_conversation_as_context(pair):
    """Multi-turn reuse: each turn equals plain decoding of the conversation, and the second
    turn, which prefills only its new tokens, extends the context the first turn left (it
    holds every position the target's cache holds, from 0)."""
    engine = build_engine(pair)
    session = ChatSession(engine, pair.tokenizer)
    for question in ["Hello there, who are you?", "And what is next?"]:
        stats = chat_turn_matches_plain_decoding(session, pair.target.model, question)
        assert stats.drafted > 0
        context = engine.drafter.context
        assert context.base == 0 and context.length == len(engine.drafter.state.ids)
