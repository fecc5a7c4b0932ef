"""The MTP drafter: a Gemma 4 target with its assistant checkpoint, loaded by the real loader
and paired, run through the engine, the runner, chat, the CLI and the auto-γ cost measurement.

Greedy output must equal mlx-lm's plain generate_step (the independent reference) for every
γ, prompts shorter and longer than the 16-token window and generation across it. A random
assistant exercises rejections; one distilled from the target's own greedy outputs (in a
few seconds) exercises long accepted runs and shows acceptance that is not chance.
"""

import mlx.core as mx
import numpy as np
import pytest
from cli_support import invoke_json
from conftest import chat_turn_matches_plain_decoding, greedy_reference
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from mlx_spec.apps.calibration import measure_costs
from mlx_spec.apps.conversation import ChatSession
from mlx_spec.apps.runner import build_engine
from mlx_spec.core.cache.forward import logits_and_hidden
from mlx_spec.core.engine import Engine
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.mtp import MtpDrafter, shared_kv
from mlx_spec.errors import IncompatibleModelsError, MlxSpecError
from mlx_spec.loading import load_pair
from mlx_spec.testing.distill import distill, teacher_data
from mlx_spec.testing.tiny import save_tiny_model
from mlx_spec.testing.tiny_gemma4 import (
    WINDOW,
    save_tiny_assistant,
    save_tiny_gemma4,
    tiny_assistant_config,
    tiny_assistant_weights,
)

pytest_plugins = ["cli_fixtures"]  # private_cost_cache

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]  # shorter than the window
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]  # longer than the window
MAX_TOKENS = 40  # every generation crosses the window
# The distilled assistant: trained on the greedy continuations of these prompts.
TRAIN_PROMPTS = [[2] + [(7 * i + 13 * k) % 250 + 6 for i in range(7)] for k in range(6)]
TRAIN_LENGTH = 56
HELD_OUT_PROMPTS = [[2] + [(7 * i + 13 * k) % 250 + 6 for i in range(7)] for k in range(10, 16)]
# Acceptance floor on those prompts at γ = 3, per position (measured: 0.97 / 0.95 / 0.92).
FLOOR = [0.9, 0.85, 0.8]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    save_tiny_gemma4(root / "target")
    save_tiny_assistant(root / "assistant")  # centroid head, as E2B/E4B
    save_tiny_assistant(root / "dense", tiny_assistant_config(centroids=False))  # as 12B
    save_tiny_model(root / "gemma3")
    return root


@pytest.fixture(scope="module")
def pair(folders):
    return load_pair(str(folders / "target"), str(folders / "assistant"), dtype="float32", progress=False)


def test_pairing_detects_the_assistant(pair):
    assert pair.draft.tokenizer is None and pair.vocab_size_draft == pair.vocab_size_target
    engine = build_engine(pair)  # no --drafter: the checkpoint's type decides
    assert isinstance(engine.drafter, MtpDrafter) and engine.drafter.layers == {
        "sliding_attention": 1, "full_attention": 2}
    with pytest.raises(MlxSpecError, match="--drafter mtp"):
        build_engine(pair, "model")


def test_mismatched_pairs_fail_with_one_line(folders):
    with pytest.raises(IncompatibleModelsError, match="Gemma 4 targets only") as error:
        load_pair(str(folders / "gemma3"), str(folders / "assistant"), progress=False)
    assert "\n" not in str(error.value)
    draft = load_pair(str(folders / "target"), str(folders / "target"), progress=False)
    with pytest.raises(MlxSpecError, match="needs a Gemma 4 MTP assistant"):
        build_engine(draft, "mtp")


def test_logits_and_hidden_is_the_target_forward(pair):
    """The engine's hidden-state pass gives a Gemma 4 target's own logits."""
    model = pair.target.model
    ids = mx.array([[2, 40, 41, 42, 43, 44]])
    logits, hidden = logits_and_hidden(model, ids, None)
    assert mx.allclose(logits, model(ids), atol=1e-5).item()
    assert hidden.shape == (1, 6, pair.target.config["hidden_size"])


def test_shared_kv_reads_the_target_cache_in_order(pair):
    """The K/V the assistant reads equal a fresh pass's, sliding ones cut to window − 1."""
    engine = build_engine(pair)
    cache = engine.make_prompt_cache()
    ids = [2] + [(5 * i) % 250 + 6 for i in range(40)]
    cache.target.prefill(ids)
    kv = shared_kv(cache.target.cache, {"sliding_attention": 1, "full_attention": 2}, WINDOW)
    assert kv["sliding_attention"][0].shape[2] == WINDOW - 1 and kv["full_attention"][0].shape[2] == 41
    fresh = pair.target.model.make_cache()
    pair.target.model(mx.array([ids]), cache=fresh)
    assert mx.allclose(kv["full_attention"][0], fresh[2].keys[..., :41, :]).item()
    sliding = fresh[1].state[0]  # mlx-lm's rotating cache, unwrapped: the newest 16 in order
    assert mx.allclose(kv["sliding_attention"][1], fresh[1].state[1][..., -(WINDOW - 1):, :]).item()
    assert mx.allclose(kv["sliding_attention"][0], sliding[..., -(WINDOW - 1):, :]).item()


def test_auto_gamma_times_the_assistant_step(pair):
    curve = measure_costs(pair.target.model, pair.draft.model, max_width=3, context=256)
    assert 0 < curve.draft_step == curve.draft_step2  # no catch-up step for the assistant


def run(engine, prompt, gamma, max_tokens=MAX_TOKENS, stats=None, **kwargs):
    stats = Stats() if stats is None else stats
    rounds = engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats, **kwargs)
    return [t for r in rounds for t in r.tokens], stats


@pytest.fixture(scope="module")
def references(pair):
    model = pair.target.model
    return {"short": greedy_reference(model, SHORT_PROMPT, MAX_TOKENS),
            "long": greedy_reference(model, LONG_PROMPT, MAX_TOKENS)}


@pytest.mark.parametrize("prompt_name", ["short", "long"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
def test_greedy_matches_plain_decoding(pair, references, prompt_name, gamma):
    prompt = SHORT_PROMPT if prompt_name == "short" else LONG_PROMPT
    tokens, stats = run(build_engine(pair), prompt, gamma)
    assert tokens == references[prompt_name]
    assert stats.drafted > 0


@pytest.fixture(scope="module")
def distilled(folders, pair):
    """A dense-head assistant (as the 12B's) trained for 120 steps on the target's own
    greedy continuations, written in the checkpoint layout and paired by the real loader."""
    from mlx_spec.models import gemma4_assistant

    config = tiny_assistant_config(centroids=False)
    assistant = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_dict(config))
    assistant.load_weights([(k, mx.array(v)) for k, v in tiny_assistant_weights(config, 1).items()])
    teacher = teacher_data(pair.target.model, TRAIN_PROMPTS, TRAIN_LENGTH)
    losses = distill(assistant, pair.target.model, teacher, iterations=120, batch=32)
    assert np.mean(losses[-10:]) < 0.25 * losses[0]
    weights = {k: np.array(v) for k, v in tree_flatten(assistant.parameters())}
    save_tiny_assistant(folders / "distilled", config, weights)
    return load_pair(str(folders / "target"), str(folders / "distilled"), dtype="float32", progress=False)


def test_distilled_assistant_accepts_well(distilled):
    """Per-position acceptance at γ = 3 on the prompts it was distilled on, and output still
    exactly the target's. A drafter fed the wrong hidden row, keys off by one or the wrong
    token embedding would not reach these numbers."""
    stats = Stats()
    for prompt in TRAIN_PROMPTS[:3]:
        engine = build_engine(distilled)
        tokens = [t for r in engine.rounds(prompt, gamma=3, max_tokens=48, stats=stats) for t in r.tokens]
        assert tokens == greedy_reference(distilled.target.model, prompt, 48)
    print(f"MTP acceptance by position {[round(a, 3) for a in stats.acceptance_by_position]}, "
          f"α̂ {stats.acceptance_rate:.3f}, mean accepted length {stats.mean_accepted_length:.2f}")
    assert all(a >= f for a, f in zip(stats.acceptance_by_position, FLOOR))
    assert len(stats.acceptance_by_position) == 3


def test_the_floor_catches_an_off_by_one_hidden_state(distilled, monkeypatch):
    """The check has power: handing the assistant the target's hidden state of the position
    before (a plausible off-by-one) brings acceptance below the floor (measured:
    0.74 / 0.72 / 0.65)."""
    def accept(self, committed, target_hidden=None):
        row = max(len(committed) - 2, 0)
        self.h = None if target_hidden is None else target_hidden[row].reshape(1, 1, -1)

    monkeypatch.setattr(MtpDrafter, "accept", accept)
    stats = Stats()
    for prompt in TRAIN_PROMPTS[:3]:
        run(build_engine(distilled), prompt, 3, 48, stats=stats)
    assert not all(a >= f for a, f in zip(stats.acceptance_by_position, FLOOR))


def test_chat_session_with_mtp(distilled):
    """Multi-turn reuse: each turn still equals plain decoding of the whole conversation."""
    tokenizer = distilled.tokenizer
    engine = build_engine(distilled)
    session = ChatSession(engine, tokenizer)
    for question in ["Hello there, who are you?", "And what is next?"]:
        chat_turn_matches_plain_decoding(session, distilled.target.model, question)


def test_cli_generate_with_the_assistant(folders, private_cost_cache):
    """`generate -m TARGET -d ASSISTANT` picks the MTP drafter by itself; greedy text equals
    drafting off; --gamma auto measures the assistant's step."""
    models = ["-m", folders / "target", "-d", folders / "assistant", "--raw", "-n", "24", "--temp", "0"]
    mtp = invoke_json(["generate", "Hello there", *models, "--gamma", "3"])
    plain = invoke_json(["generate", "Hello there", *models, "--drafter", "none"])
    assert mtp["drafter"] == "mtp" and mtp["text"] == plain["text"]
    assert mtp["stats"]["drafted"] > 0 and len(mtp["stats"]["acceptance_by_position"]) == 3
    auto = invoke_json(["generate", "Hello there", *models, "--gamma", "auto", "--drafter", "mtp"])
    assert auto["text"] == plain["text"] and auto["gamma"] == "auto"


def test_cli_bench_with_the_assistant(folders, private_cost_cache):
    """`bench` sweeps γ for the MTP pair; every setting md5-identical to drafting off."""
    out = invoke_json(["bench", "-m", folders / "target", "-d", folders / "assistant", "--prompt",
                       "Hello there", "--runs", "1", "--max-tokens", "12", "--gamma", "2", "--auto"])
    assert out["ok"] and out["identity_checked"] and out["drafter"] == "mtp"
    assert len({s["md5"] for s in out["settings"]}) == 1 and out["costs"]["draft_step"] > 0


def test_position_setting(pair, references, monkeypatch):
    """The other position convention is a setting (MLX_SPEC_MTP_POSITION or position=);
    output stays exact; a bad value is a one-line error."""
    monkeypatch.setenv("MLX_SPEC_MTP_POSITION", "previous")
    engine = build_engine(pair)
    assert engine.drafter.position == "previous"
    assert run(engine, LONG_PROMPT, 3)[0] == references["long"]
    monkeypatch.setenv("MLX_SPEC_MTP_POSITION", "next")
    with pytest.raises(MlxSpecError, match="MLX_SPEC_MTP_POSITION"):
        build_engine(pair)


# ---------------------------------------------------------------------------------------
# Round 1 drafts: the prefill hands the assistant the last prefilled position's hidden state
# ---------------------------------------------------------------------------------------


def recording(engine):
    """Wrap the engine's MTP drafter so that every proposal's tokens are kept, in order."""
    drafter, proposals = engine.drafter, []
    propose = drafter.propose

    def record(gamma, history, key=None):
        draft = propose(gamma, history, key)
        proposals.append(draft.tokens.tolist())
        return draft

    drafter.propose = record
    return proposals


def independent_first_draft(target, assistant, prompt, gamma):
    """The first draft as computed from scratch, apart from the engine, its caches and
    `draft_greedy`: mlx-lm's plain caches and one target pass over prompt[:-1]; h = the final
    (post-norm) hidden state at its last row; the assistant's full logits, argmax, γ steps
    at the transformers position (the tokens in the target's cache)."""
    inner = target.model
    cache = [KVCache() for _ in target.make_cache()]  # every key kept; the mask keeps the window
    h = inner(mx.array([prompt[:-1]]), cache=cache)[:, -1:, :]
    held = len(prompt) - 1
    first = max(0, held - (WINDOW - 1))  # the sliding layer's window − 1 newest keys
    kv = {"sliding_attention": (cache[1].keys[..., first:held, :], cache[1].values[..., first:held, :]),
          "full_attention": (cache[2].keys[..., :held, :], cache[2].values[..., :held, :])}
    token, tokens = mx.array([[prompt[-1]]]), []
    for _ in range(gamma):
        embedded = inner.embed_tokens(token) * inner.embed_scale
        logits, h = assistant(mx.concatenate([embedded, h], axis=-1), kv, held)
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.item())
    return tokens


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT, SHORT_PROMPT[:2]], ids=["short", "long", "two"])
def test_first_round_drafts(pair, prompt):
    """Round 1 after the prefill drafts γ tokens (it used to be plain: no hidden state)."""
    engine = build_engine(pair)
    stats = Stats()
    first = next(iter(engine.rounds(prompt, gamma=3, max_tokens=MAX_TOKENS, stats=stats)))
    assert first.gamma == 3 and stats.drafted == 3 and stats.rounds == 1


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT, SHORT_PROMPT[:2]], ids=["short", "long", "two"])
def test_first_draft_equals_an_independent_computation(pair, prompt):
    """The first draft is the assistant's from the target's hidden state at prompt[-2],
    fed prompt[-1]: the same tokens as computed apart from the engine."""
    engine = build_engine(pair)
    proposals = recording(engine)
    next(iter(engine.rounds(prompt, gamma=4, max_tokens=MAX_TOKENS)))
    assert proposals[0] == independent_first_draft(pair.target.model, pair.draft.model, prompt, 4)


def test_prefill_hidden_is_the_last_chunks_own(pair):
    """`prefill(hidden=True)` keeps the last fed position's final hidden state, across
    chunks, equal to one whole pass's; without hidden=True it keeps nothing."""
    engine = build_engine(pair)
    ids = LONG_PROMPT[:-1]
    whole = pair.target.model.model(mx.array([ids]))[:, -1:, :]
    cache = engine.make_prompt_cache()
    assert cache.target.prefill(ids, chunk_size=16, hidden=True) == len(ids)
    assert cache.target.prefill_hidden.shape == whole.shape
    assert mx.allclose(cache.target.prefill_hidden, whole, atol=1e-4).item()
    assert cache.target.prefill(ids, hidden=True) == 0 and cache.target.prefill_hidden is None
    plain = engine.make_prompt_cache()
    plain.target.prefill(ids)
    assert plain.target.prefill_hidden is None


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT, [2], SHORT_PROMPT[:2]],
                         ids=["short", "long", "one", "two"])
@pytest.mark.parametrize("gamma", [2, 5])
def test_greedy_from_round_one_matches_plain_decoding(pair, prompt, gamma):
    """Drafting from round 1 keeps greedy output mlx-lm's; a one-token prompt prefills
    nothing, so its round 1 is plain (there is no hidden state before the first token)."""
    engine = build_engine(pair)
    rounds = list(engine.rounds(prompt, gamma=gamma, max_tokens=MAX_TOKENS))
    assert [t for r in rounds for t in r.tokens] == greedy_reference(pair.target.model, prompt, MAX_TOKENS)
    assert rounds[0].gamma == (0 if len(prompt) == 1 else gamma)
    assert sum(r.gamma for r in rounds) > 0


def test_nothing_prefilled_reuses_the_last_rounds_hidden_state(pair):
    """A request whose prompt is exactly the cached ids plus one token prefills nothing; the
    h the last round handed over is then the right one: round 1 drafts what an independent
    computation gives, and output stays plain decoding's. If the cache rolled back instead
    (prompt shorter than what it holds), no h is right and round 1 is plain."""
    engine = build_engine(pair)
    cache = engine.make_prompt_cache()
    prompt = SHORT_PROMPT
    tokens = run(engine, prompt, 3, max_tokens=12, prompt_cache=cache)[0]
    follow = prompt + tokens  # the cache holds follow[:-1]
    assert cache.target.ids == follow[:-1]
    proposals = recording(engine)
    rounds = list(engine.rounds(follow, gamma=3, max_tokens=MAX_TOKENS, prompt_cache=cache))
    assert rounds[0].gamma == 3
    assert proposals[0] == independent_first_draft(pair.target.model, pair.draft.model, follow, 3)
    assert [t for r in rounds for t in r.tokens] == greedy_reference(pair.target.model, follow, MAX_TOKENS)
    shorter = cache.target.ids[:-2] + [cache.target.ids[-2]]  # holds shorter[:-1] after a rollback
    rounds = list(engine.rounds(shorter, gamma=3, max_tokens=12, prompt_cache=cache))
    assert rounds[0].gamma == 0
    assert [t for r in rounds for t in r.tokens] == greedy_reference(pair.target.model, shorter, 12)


def test_chat_turns_draft_from_round_one(distilled):
    """Each chat turn (the second prefills only its new tokens) drafts in its first round
    and still equals plain decoding of the conversation."""
    engine = build_engine(distilled)
    session = ChatSession(engine, distilled.tokenizer)
    proposals = recording(engine)
    begin, starts = engine.drafter.begin, []

    def begin_and_mark(prompt_ids, prompt_cache, processor=None):
        starts.append(len(proposals))
        return begin(prompt_ids, prompt_cache, processor)

    engine.drafter.begin = begin_and_mark
    for question in ["Hello there, who are you?", "And what is next?"]:
        chat_turn_matches_plain_decoding(session, distilled.target.model, question)
    assert len(starts) == 2
    assert all(len(proposals[i]) == 3 for i in starts)


# ---------------------------------------------------------------------------------------
# Draft trees: siblings from the assistant's logits where its top-1 is split


def flat_tree_policy():
    """Width costs nothing: every sibling the assistant proposes is verified."""
    from mlx_spec.core.cost_model import CostCurve
    from mlx_spec.core.policy import TreePolicy

    return TreePolicy(CostCurve([0.01] * 17, 0.0, 256), max_gamma=3, learn_costs=False)


@pytest.mark.parametrize("prompt_name", ["short", "long"])
def test_greedy_trees_match_plain_decoding(pair, references, prompt_name):
    prompt = SHORT_PROMPT if prompt_name == "short" else LONG_PROMPT
    tokens, stats = run(build_engine(pair), prompt, flat_tree_policy())
    assert tokens == references[prompt_name]
    assert stats.tree_rounds > 0 and sum(stats.tried_at_rank[1:]) > 0


def test_trees_hand_the_assistant_the_accepted_paths_hidden_state(distilled):
    """After a tree round the assistant's h is the target's final hidden state at the last
    committed position but one, read from the tree row on the accepted path (not block row
    i): equal to the target's own, computed on the committed sequence fed whole without a
    cache. Some accepted paths run through siblings, whose rows are off the block prefix."""
    from mlx_spec.core.cache.forward import final_hidden

    engine = build_engine(distilled)
    drafter, target = engine.drafter, distilled.target.model
    stats, checked = Stats(), []
    # prompts it was not trained on, where its top-1 is sometimes wrong and a sibling right
    # (on its training prompts it can be right every time, which leaves siblings untried)
    for prompt in HELD_OUT_PROMPTS:
        sequence = list(prompt)
        accept = drafter.accept

        def recording(committed, target_hidden=None):
            accept(committed, target_hidden)
            sequence.extend(committed)
            reference = final_hidden(target, mx.array(sequence[:-1])[None], None)[0, -1]
            checked.append(mx.allclose(drafter.h.reshape(-1), reference, atol=1e-4).item())

        drafter.accept = recording
        tokens = [t for r in engine.rounds(prompt, gamma=flat_tree_policy(), max_tokens=48, stats=stats)
                  for t in r.tokens]
        drafter.accept = accept
        assert tokens == greedy_reference(target, prompt, 48)
    assert checked and all(checked)
    assert stats.tree_rounds > 0 and sum(stats.accepted_at_rank[1:]) > 0


def test_batched_mtp_rows_match_plain_decoding(distilled, monkeypatch):
    """Two MTP requests in one batch (`mlx_spec.core.batch`): each answer is still mlx-lm's
    greedy one, and each row's drafter drafts what it drafts alone (its own row's hidden
    states and K/V reached it: a neighbour's would change the drafts, not the answer); the
    rows' assistant steps share calls (γ 3 and 2: three a round, not five)."""
    from mlx_spec.core.batch import Batch

    engine = build_engine(distilled)  # trained on these prompts: its drafts follow h
    assistant, calls = engine.drafter.model, []
    real = type(assistant).hidden
    monkeypatch.setattr(type(assistant), "hidden",
                        lambda self, *args, **kwargs: calls.append(self is assistant) or real(self, *args, **kwargs))
    out = {}
    batch = Batch(out=lambda generator, r: out[generator].append((r.gamma, r.accepted, r.tokens)))
    requests, alone = [], []
    for prompt, gamma in ((TRAIN_PROMPTS[0], 3), (TRAIN_PROMPTS[1], 2)):
        rounds = engine.for_request().rounds(prompt, gamma=gamma, max_tokens=TRAIN_LENGTH, batched=True)
        out[rounds] = []
        requests.append(rounds)
        batch.add(rounds)
        alone.append([(r.gamma, r.accepted, r.tokens) for r in
                      engine.for_request().rounds(prompt, gamma=gamma, max_tokens=TRAIN_LENGTH)])
    widths, per_step = [], []
    del calls[:]  # the requests decoded alone
    while len(batch):
        before = len(calls)
        widths.append(len(batch.step()))
        per_step.append(len(calls) - before)
    assert max(widths) == 2 and widths[0] == 2 and per_step[0] == 3
    assert max(per_step) <= 3
    for rounds, prompt, own in zip(requests, TRAIN_PROMPTS, alone):
        tokens = [t for _, _, round_tokens in out[rounds] for t in round_tokens]
        assert tokens == greedy_reference(distilled.target.model, prompt, TRAIN_LENGTH)
        assert out[rounds] == own
        assert sum(accepted for _, accepted, _ in own) > 0
