"""Getting target and draft models into MLX memory.

    load_model(source)          one model + tokenizer from the embedded default, a .gguf file,
                                a local folder, a Hugging Face repo id, or a model in Ollama's
                                store / LM Studio's folder (ollama:NAME, lmstudio:PUB/MODEL;
                                see stores) -> LoadedModel
    load_pair(target, draft)    both, checked compatible, with their logits widths -> ModelPair
    check_compatible(t, d)      the tokenizer check alone
    list_presets / get_preset   named target + draft pairs (presets/presets.toml)
    model_info(source)          architecture, size, quantization, vocabulary, without running it

Names resolve lazily, so importing one of its modules does not pay for importing mlx-lm's
tokenizer stack.
"""

from importlib import import_module

_EXPORTS = {
    "LoadedModel": "loader",
    "load_model": "loader",
    "check_source": "sources",
    "default_dtype": "loader",
    "cache_root": "sources",
    "ModelPair": "pairing",
    "load_pair": "pairing",
    "check_compatible": "pairing",
    "output_width": "pairing",
    "Preset": "presets",
    "list_presets": "presets",
    "get_preset": "presets",
    "model_info": "info",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"mlx_spec.loading.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'mlx_spec.loading' has no attribute {name!r}")
