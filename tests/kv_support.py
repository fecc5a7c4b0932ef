"""Quantized K/V tests' reference (tests/cache): mlx-lm's own decoding loop on our cache
layers, the prompt fed one token at a time, where nothing but a position decides its
precision."""

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_spec.core.cache.layers import KVQuantization, QuantizedKVReader, make_cache

PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]  # past the tiny models' window of 16
MAX_TOKENS = 40
GROUP = 32  # the tiny models' head size is 32 (64 on Gemma 4's full layers)


class SharedLayersRead:
    """`model` for mlx-lm's loop: Gemma 4's KV-shared layers (no cache of their own) get a
    `QuantizedKVReader` once the owners' K/V are quantized, as `SequenceCache._call` gives them."""

    def __init__(self, model):
        self.model = model

    def __call__(self, inputs, cache, **kwargs):
        reader = QuantizedKVReader.of(cache[0])
        shared = len(self.model.layers) - len(cache)
        return self.model(inputs, cache=cache + [reader] * shared if reader else cache, **kwargs)


def mlx_lm_decoding(model, kv: KVQuantization, prompt=PROMPT, max_tokens=MAX_TOKENS) -> list[int]:
    """Greedy tokens of mlx-lm's own `generate_step` (its prefill, its switch to quantized
    K/V, its decode loop: no drafting) run on our cache layers (`make_cache`), the prompt fed
    one token at a time: then a row's K/V precision depends on its position alone (mlx-lm
    switches after the forward that reaches `start`), which is our rule for any chunking."""
    steps = generate_step(mx.array(prompt), SharedLayersRead(model), max_tokens=max_tokens,
                          prompt_cache=make_cache(model, slack=4), kv_bits=kv.bits, prefill_step_size=1,
                          kv_group_size=kv.group_size, quantized_kv_start=kv.start)
    return [token for token, _ in steps]
