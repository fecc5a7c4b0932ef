"""mlx-spec: exact speculative decoding on MLX.

    from mlx_spec import load_pair, build_engine, gamma_policy, generate, SamplingParams

    pair = load_pair(None)                  # the embedded Gemma 3 270M (or HF id, folder, .gguf)
    engine = build_engine(pair)             # drafter: the draft model if loaded, else suffix
    result = generate(engine, pair.tokenizer, "The capital of France is",
                      SamplingParams(temperature=0), gamma=gamma_policy("auto", engine))
    print(result.text, result.stats.acceptance_rate)

Layers: `Engine.rounds` (token ids) → `stream_generate` (text) → `generate` (one result);
`ChatSession` carries both models' caches across turns. The package, bottom-up: `platform`
(the libraries under us), `core` (the round loop and its caches), `models` (architectures
mlx-lm lacks), `drafters`, `loading` (models and stores), `runtime` (process set-up), `apps`
(services over the engine), `server`, `cli`; docs/design.md has the map.
"""

from importlib import import_module

from mlx_spec import runtime as _runtime

# Before anything else imports mlx.core or mlx-lm: the BLAS, mlx-lm's deferred __init__ and
# its quantized attention routed through ours (each listed and justified in `runtime`).
_runtime.install()

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "core.engine",
    "Round": "core.engine",
    "SamplingParams": "core.sampling",
    "Stats": "core.stats",
    "AutoGamma": "core.policy",
    "FixedGamma": "core.policy",
    "ModelDrafter": "drafters",
    "NgramDrafter": "drafters",
    "load_model": "loading",
    "load_pair": "loading",
    "stream_generate": "apps.stream",
    "generate": "apps.stream",
    "ChatSession": "apps.conversation",
    "build_engine": "apps.runner",
    "gamma_policy": "apps.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"mlx_spec.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'mlx_spec' has no attribute {name!r}")
