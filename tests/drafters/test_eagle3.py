"""EAGLE-3: tiny random drafts built and written by mlx-vlm's own `Eagle3DraftModel` in vLLM's
speculators packaging (reduced vocabulary: d2t, t2d), for a tiny Gemma 4 target.

- draft parity: fed the same target states and tokens, our draft tokens are mlx-vlm's
  drafter's (`prefill_from_target_hidden`, `draft_block`, `accept_verified_tokens`);
- `hidden_act` is honoured: with GELU our logits are mlx-vlm's class with its MLP's SiLU
  swapped for GELU, and differ from mlx-vlm's own (which always uses SiLU);
- greedy output is mlx-lm's plain decoding even where the target's argmax is outside the
  draft vocabulary, where mlx-vlm's rule (the best token among the draft vocabulary) is not;
- chi-square at T = 1 with a reduced vocabulary (q mapped through d2t);
- a draft that does not fit the target is refused in one line.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_vlm.speculative.drafters import load_drafter
from mlx_vlm.speculative.eagle3 import _eagle3_hot_logits_from_hidden, _eagle3_hot_token_ids

import mlx_spec.core.verify as verify_module
from conftest import chat_turn_matches_plain_decoding, greedy_reference
from mlx_spec.core.cache.forward import final_hidden
from mlx_spec.apps.conversation import ChatSession
from mlx_spec.core.batch import Batch
from mlx_spec.drafters.eagle3 import Eagle3Drafter
from mlx_spec.core.engine import Engine
from mlx_spec.errors import IncompatibleModelsError
from mlx_spec.core.grammar import compile_grammar
from mlx_spec.loading import load_pair
from mlx_spec.models import eagle3
from mlx_spec.apps.runner import build_engine
from mlx_spec.core.sampling import LogitProcessor, SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.testing.tiny_block_drafts import (
    draft_vocabulary,
    reference_eagle3,
    save_tiny_eagle3,
    tiny_eagle3_config,
)
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4, tiny_gemma4
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, recovered_from_p, sampled_joint
from grammar_support import ADDRESS, EOS, TOKENIZER, constrained_reference
from grammar_support import PROMPT as ADDRESS_PROMPT

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_gemma4()


@pytest.fixture(scope="module")
def outside(target):
    """Target ids plain decoding emits after the prompts: the draft vocabulary lacks them."""
    return sorted({t for p in (SHORT_PROMPT, LONG_PROMPT) for t in greedy_reference(target, p, MAX_TOKENS)})


@pytest.fixture(scope="module")
def folders(tmp_path_factory, target, outside):
    root = tmp_path_factory.mktemp("eagle3")
    save_tiny_gemma4(root / "target", target)
    embed = target.model.embed_tokens.weight
    save_tiny_eagle3(root / "eagle3", embed=embed)
    vocab = draft_vocabulary(64, 272, skip=tuple(outside))
    save_tiny_eagle3(root / "narrow", vocab_ids=vocab, embed=embed)  # lacks every token the target says
    return root


@pytest.fixture(scope="module")
def pair(folders):
    return load_pair(str(folders / "target"), str(folders / "eagle3"), dtype="float32", progress=False)


def run(engine, prompt, gamma, max_tokens=MAX_TOKENS, **kwargs):
    stats = Stats()
    tokens = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats, **kwargs)
              for t in r.tokens]
    return tokens, stats


def test_the_folder_is_detected_and_mlx_vlm_loads_it_too(folders, pair):
    reference, kind = load_drafter(str(folders / "eagle3"))
    assert kind == "eagle3" and type(reference).__name__ == "Eagle3DraftModel"
    engine = build_engine(pair)
    assert isinstance(engine.drafter, Eagle3Drafter)
    assert engine.wants_hidden == (1, 3, 4)  # aux states 2, 4, 5: the outputs of layers 1, 3, 4
    assert pair.draft.model.d2t.dtype == mx.int32 and pair.vocab_size_draft == 272


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_draft_parity_with_mlx_vlm(folders, pair, prompt):
    """Round 1 from the prompt's states; round 2 after 2 accepted drafts and a bonus."""
    reference, _ = load_drafter(str(folders / "eagle3"))
    reference.reset(pair.target.model)
    drafter = build_engine(pair).drafter
    cache = Engine(pair.target.model, drafter).make_prompt_cache()
    cache.target.prefill(prompt[:-1], hidden=drafter.tap_layers)
    taps = cache.target.prefill_hidden
    drafter.begin(prompt, cache, LogitProcessor(SamplingParams()))
    argmax = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    reference.prefill_from_target_hidden(mx.array([prompt[:-1]]), taps, prompt[-1], argmax, greedy=True)
    expected = reference.draft_block(prompt[-1], None, None, 5, argmax, greedy=True)
    ours = drafter.propose(4, prompt)
    assert ours.tokens.tolist() == expected[0].tolist()
    verify = mx.random.normal((1, 5, 192), key=mx.random.key(3))  # the round's pass's rows
    committed = expected[0, :2].tolist() + [77]
    reference.accept_verified_tokens(verify, expected, 2, committed, argmax, greedy=True)
    drafter.accept(committed, verify[0])
    expected = reference.draft_block(77, None, None, 4, argmax, greedy=True)
    assert drafter.propose(3, prompt + committed).tokens.tolist() == expected[0].tolist()


def test_hidden_act_is_honoured_where_mlx_vlm_uses_silu(target):
    config = tiny_eagle3_config(target.config, hidden_act="gelu")
    vocab = draft_vocabulary(64, 272)
    reference = reference_eagle3(config, vocab, seed=1, embed=target.model.embed_tokens.weight)
    ours = eagle3.Model(eagle3.ModelArgs.from_dict(config))
    ours.load_weights(list(tree_flatten(reference.parameters())))
    tokens, taps = mx.array([[40, 41, 42]]), mx.random.normal((1, 3, 192), key=mx.random.key(0))
    logits = ours.logits(ours.hidden(tokens, taps, ours.make_cache(), 1, taps=True))

    def reference_logits():
        reference.reset(target)
        return reference._logits(reference._forward_tokens(tokens, taps, mx.int32))

    silu = reference_logits()
    mlp = type(reference.layers[0].mlp)
    gelu_mlp = lambda self, x: self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))  # noqa: E731
    real = mlp.__call__
    mlp.__call__ = gelu_mlp
    try:
        gelu = reference_logits()
    finally:
        mlp.__call__ = real
    assert mx.allclose(logits, gelu, atol=1e-4).item()
    assert not mx.allclose(logits, silu, atol=1e-2).item()


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_matches_plain_decoding(pair, prompt, gamma):
    tokens, stats = run(build_engine(pair), prompt, gamma)
    assert tokens == greedy_reference(pair.target.model, prompt, MAX_TOKENS)
    assert stats.drafted > 0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_batched_rows_draft_as_alone_with_each_step_one_forward(pair, params, monkeypatch):
    """Two requests in one batch: each request drafts the tokens it drafts alone and its
    rounds are its rounds alone (greedy: mlx-lm's plain decoding; seeded T = 1: the same
    draws), and their draft steps after the first run as one draft forward for both rows."""
    engine = build_engine(pair)
    calls, drafted = [], {}
    real_rows, real_drafting = eagle3.Model.step_rows, Eagle3Drafter.drafting

    def drafting(self, gamma, history, key=None):
        draft = yield from real_drafting(self, gamma, history, key)
        drafted.setdefault(tuple(history[:3]), []).append(draft.tokens.tolist())
        return draft

    monkeypatch.setattr(eagle3.Model, "step_rows", lambda self, tokens, *a: calls.append(tokens.shape[0]) or real_rows(self, tokens, *a))
    monkeypatch.setattr(Eagle3Drafter, "drafting", drafting)
    out, requests, alone = {}, [], []
    batch = Batch(out=lambda generator, r: out[generator].append((r.gamma, r.accepted, r.tokens)))
    for prompt, gamma in ((SHORT_PROMPT, 3), (LONG_PROMPT, 4)):
        rounds = engine.for_request().rounds(prompt, params, gamma=gamma, max_tokens=MAX_TOKENS, batched=True)
        out[rounds] = []
        requests.append(rounds)
        batch.add(rounds)
        alone.append([(r.gamma, r.accepted, r.tokens) for r in
                      engine.for_request().rounds(prompt, params, gamma=gamma, max_tokens=MAX_TOKENS)])
    assert not calls  # alone, a step runs by itself
    drafted_alone, drafted = drafted, {}
    while len(batch):
        batch.step()
    assert 2 in calls
    assert drafted == drafted_alone and all(len(d) > 3 for d in drafted.values())
    for rounds, prompt, own in zip(requests, (SHORT_PROMPT, LONG_PROMPT), alone):
        if params.greedy:
            assert [t for _, _, tokens in out[rounds] for t in tokens] == greedy_reference(
                pair.target.model, prompt, MAX_TOKENS)
        assert out[rounds] == own


def test_greedy_is_exact_where_the_argmax_is_outside_the_draft_vocabulary(folders, outside):
    """Every token plain decoding emits is outside the narrow draft's vocabulary: our output
    is still plain decoding's, while mlx-vlm's rule, the target's best token among the
    draft vocabulary (and EOS), picks another token at every one of those positions."""
    narrow = load_pair(str(folders / "target"), str(folders / "narrow"), dtype="float32", progress=False)
    model = narrow.target.model
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        reference = greedy_reference(model, prompt, MAX_TOKENS)
        tokens, stats = run(build_engine(narrow), prompt, 3)
        assert tokens == reference and stats.drafted > 0
        hidden = final_hidden(model, mx.array([prompt + reference[:-1]]), None)[:, len(prompt) - 1 :]
        draft_model = load_drafter(str(folders / "narrow"))[0]
        hot = _eagle3_hot_token_ids(model, draft_model, [1])
        mlx_vlm_tokens = hot[mx.argmax(_eagle3_hot_logits_from_hidden(model, draft_model, hidden, hot), axis=-1)]
        assert all(a != b for a, b in zip(mlx_vlm_tokens[0].tolist(), reference))
        assert not set(reference) & set(narrow.draft.model.target_ids().tolist())


def test_greedy_under_a_grammar_matches_constrained_decoding(pair):
    engine = Engine(pair.target.model, build_engine(pair).drafter, eos_ids=EOS)
    grammar = compile_grammar(TOKENIZER, "json_schema", ADDRESS, EOS).matcher(EOS)
    tokens, stats = run(engine, ADDRESS_PROMPT, 3, max_tokens=60, constraint=grammar)
    assert [t for t in tokens if t not in EOS] == constrained_reference(pair.target.model, ADDRESS_PROMPT, ADDRESS, 60)
    assert stats.drafted > 0


@pytest.fixture(scope="module")
def small():
    """A target over 8 tokens and an EAGLE-3 draft over 5 of them (d2t)."""
    target = tiny_gemma4(seed=2, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, logit_scale=0.5)
    config = tiny_eagle3_config(target.config, draft_vocab=5)
    reference = reference_eagle3(config, [0, 1, 3, 4, 6], seed=4, embed=target.model.embed_tokens.weight)
    draft = eagle3.Model(eagle3.ModelArgs.from_dict(config))
    draft.load_weights(list(tree_flatten(reference.parameters())))
    return target, draft


DRAWS = 1000
BROKEN_DRAWS = 500
GAMMA = 2


def test_sampling_matches_target_distribution(small):
    target, draft = small
    params = SamplingParams(**PARAMS)
    engine = Engine(target, Eagle3Drafter(draft, target))
    stats = Stats()
    list(engine.rounds([2, 5, 3, 5, 1], params, gamma=GAMMA, max_tokens=3, stats=stats))
    assert stats.drafted > 0
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, DRAWS), exact_joint(target, params))
    assert stat < critical


def test_the_check_catches_a_broken_rule(small, monkeypatch):
    target, draft = small
    params = SamplingParams(**PARAMS)
    monkeypatch.setattr(verify_module, "verify_sampled", recovered_from_p)
    engine = Engine(target, Eagle3Drafter(draft, target))
    stat, critical = chi_square(sampled_joint(engine, params, GAMMA, BROKEN_DRAWS), exact_joint(target, params))
    assert stat > critical


@pytest.mark.parametrize("change, message", [
    (dict(target_hidden_size=32), "hidden size 32; this target's is 64"),
    (dict(eagle_aux_hidden_state_layer_ids=[2, 4, 9]), "this target has 6 layers"),
])
def test_a_draft_that_does_not_fit_is_refused_in_one_line(folders, change, message):
    save_tiny_eagle3(folders / "wrong", tiny_eagle3_config(**change))
    with pytest.raises(IncompatibleModelsError, match=message) as error:
        load_pair(str(folders / "target"), str(folders / "wrong"), progress=False)
    assert "\n" not in str(error.value)


def test_chat_turns_keep_the_whole_conversation_in_the_drafts_cache(pair):
    """Each turn equals plain decoding; the second turn extends the entries the first left."""
    engine = build_engine(pair)
    session = ChatSession(engine, pair.tokenizer)
    for question in ["Hello there, who are you?", "And what is next?"]:
        assert chat_turn_matches_plain_decoding(session, pair.target.model, question).drafted > 0
        assert engine.drafter.base == 0 and engine.drafter.length == len(engine.drafter.state.ids)
