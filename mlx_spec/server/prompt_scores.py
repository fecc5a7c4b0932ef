"""The prompt's own log-probs (completions' `echo` with `logprobs`, what evaluation harnesses
such as lm-eval read for log-likelihood tasks): the target's log-prob of each prompt token
given the tokens before it, from a forward of the whole prompt in a fresh cache of its own.

The forward runs in `chunk`-token blocks through mlx-lm's own cache (`make_prompt_cache`),
full precision whatever `--kv-bits` says, so the numbers are the target's as mlx-lm's
forward gives them; the prompt caches the answers use are not touched. The first token has
no log-prob (nothing precedes it): None, as OpenAI's and vLLM's answers have it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_spec.core.engine import log_softmax, token_logprobs


def prompt_logprobs(model, ids: list[int], top: int, chunk: int = 512) -> list[tuple]:
    """(id, its log-prob or None, [(id, log-prob)...] top alternatives) per prompt token."""
    cache = make_prompt_cache(model)
    scored: list[tuple] = [(ids[0], None, [])]
    fed = ids[:-1]  # position i predicts token i + 1; the last one predicts past the prompt
    for start in range(0, len(fed), chunk):
        block = fed[start:start + chunk]
        logits = model(mx.array(block)[None], cache=cache)[0]  # [len(block), V]
        targets = ids[start + 1:start + 1 + len(block)]
        scored += [(t, lp, alternatives)
                   for t, (lp, alternatives) in zip(targets, token_logprobs(log_softmax(logits), targets, top))]
    return scored
