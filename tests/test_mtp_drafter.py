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
from mlx.utils import tree_flatten

from cli_support import invoke_json
from conftest import chat_turn_matches_plain_decoding, greedy_reference
from mlx_spec.cache import logits_and_hidden
from mlx_spec.chat import ChatSession
from mlx_spec.costs import measure_costs
from mlx_spec.drafters.mtp import MtpDrafter, shared_kv
from mlx_spec.engine import Engine
from mlx_spec.errors import IncompatibleModelsError, MlxSpecError
from mlx_spec.models import load_pair
from mlx_spec.models.distill import distill, teacher_data
from mlx_spec.models.tiny import save_tiny_model
from mlx_spec.models.tiny_gemma4 import (
    WINDOW,
    save_tiny_assistant,
    save_tiny_gemma4,
    tiny_assistant_config,
    tiny_assistant_weights,
)
from mlx_spec.runner import build_engine
from mlx_spec.stats import Stats

pytest_plugins = ["cli_fixtures"]  # private_cost_cache

SHORT_PROMPT = [2, 40, 41, 42, 43, 44, 45, 40, 41]  # shorter than the window
LONG_PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]  # longer than the window
MAX_TOKENS = 40  # every generation crosses the window
# The distilled assistant: trained on the greedy continuations of these prompts.
TRAIN_PROMPTS = [[2] + [(7 * i + 13 * k) % 250 + 6 for i in range(7)] for k in range(6)]
TRAIN_LENGTH = 56
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
    assert stats.drafted > 0  # it drafted from the second round on


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
