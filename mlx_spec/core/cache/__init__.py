"""Both models' KV caches, exact rollback, and the forwards that feed them.

Import a name from the module that defines it; each module imports only modules below it:

    mlx_lm_files   prompt caches in mlx-lm's file layout (`generate --prompt-cache FILE`)
    files          prompt caches in our files: cache_key, save_prompt_cache, load_prompt_cache
    sequence       SequenceCache (one model's cache and the ids it holds: prefill, forward,
                   settle, rollback, fork), PromptCache (both models'), common_prefix_length
    forward        forward_model, logits_and_hidden, final_hidden; feeding a draft tree
                   (masks, RoPE by depth) or an image; attention_layers, tree_capable
    layers         make_cache (a model's layers: ours where mlx-lm's cannot roll back),
                   KVQuantization (--kv-bits), QuantizedKVReader
    attention      attention over quantized K/V, and the dispatch mlx-lm's attention is
                   routed to (by `mlx_spec.runtime`, not on import)
    window_layers  WindowKVCache, QuantizedWindowKVCache: sliding windows that roll back
    global_layers  TreeKVCache, ChannelQuantizedKVCache (keys quantized by channel)
    layer_base     what the layers share: tree-mask, trim and serialisation mixins, K/V slots
"""
