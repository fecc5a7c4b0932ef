"""With `--kv-bits`, a row's K/V precision is a function of its position alone (issues 45
item 2, 46 item 6): not of how the prompt was chunked (a batch prefills in 128-token
chunks, a serial request in 512), nor of what a reused cache held before.

References: the same prompt under another chunking, bit for bit; mlx-lm's own
`generate_step` fed one token at a time (`prefill_step_size=1`, where nothing but the
position can decide), on our cache layers; a fresh cache for a reused one; a serial
worker's first job for the same job after another.
"""

import mlx.core as mx
import numpy as np
import pytest
from batch_support import batched
from kv_support import GROUP, mlx_lm_decoding
from server_support import Server, server_env
from worker_support import pair, run_jobs  # noqa: F401  (pair: a fixture)

from mlx_spec.core.cache.layers import KVQuantization
from mlx_spec.core.cache.sequence import SequenceCache
from mlx_spec.core.engine import Engine
from mlx_spec.core.stats import Stats
from mlx_spec.drafters import ModelDrafter
from mlx_spec.server.worker import Done, Worker
from mlx_spec.testing.tiny import TINY_VOCAB

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache

LONG = [2] + [(7 * i) % 250 + 6 for i in range(299)]  # 300 tokens: chunks of 128 and 512 differ
MAX_TOKENS = 24
FOLLOW = "a fisherman who told his son every night that the sea was calm, "  # ~60 rows past a cached story


def last_logits(model, kv, prompt, chunk):
    cache = SequenceCache(model, 4, kv=kv)
    cache.prefill(prompt[:-1], chunk)
    return np.array(cache.forward(mx.array(prompt[-1:])))


@pytest.mark.parametrize("bits", [8, 4])
def test_last_logits_do_not_depend_on_the_prefill_chunks(tiny_target, bits):
    """Equal up to the BLAS's rounding across matmul widths (full precision differs by ~1e-4
    between these chunkings; a quantized row rounding across a bin's edge by ~1e-3), where
    switching after the first chunk differed by 0.5 at 8 bits and 10 at 4."""
    kv = KVQuantization(bits, GROUP)
    logits = [last_logits(tiny_target, kv, LONG, chunk) for chunk in (128, 512, 37)]
    assert max(np.abs(other - logits[0]).max() for other in logits[1:]) < 1e-2
    assert not np.allclose(logits[0], last_logits(tiny_target, None, LONG, 512))  # the bits tell


def tokens(rounds) -> list[int]:
    return [t for r in rounds for t in r.tokens]


def test_greedy_text_batched_serial_reused_and_fresh_is_mlx_lm_s_one_token_at_a_time(tiny_target, tiny_draft):
    kv = KVQuantization(4, GROUP)

    def engine():
        return Engine(tiny_target, ModelDrafter(tiny_draft, TINY_VOCAB), kv=kv, draft_kv=kv)

    reference = mlx_lm_decoding(tiny_target, kv, LONG, MAX_TOKENS)
    assert tokens(engine().rounds(LONG, gamma=3, max_tokens=MAX_TOKENS)) == reference  # serial: 512 a chunk
    together = engine().rounds(LONG, gamma=3, max_tokens=MAX_TOKENS, batched=True)  # 128 a chunk
    out = {together: []}
    batched([together], [0], out)
    assert out[together] == reference
    # a cache that held the first 250 tokens and a short answer, cut back to the 250
    spec = engine()
    cache = spec.make_prompt_cache()
    list(spec.rounds(LONG[:250], gamma=3, max_tokens=4, prompt_cache=cache))
    stats = Stats()
    assert tokens(spec.rounds(LONG, gamma=3, max_tokens=MAX_TOKENS, prompt_cache=cache, stats=stats)) == reference
    assert stats.prefill_tokens < len(LONG)  # both caches together: it did reuse them
    assert reference != mlx_lm_decoding(tiny_target, KVQuantization(8, GROUP), LONG, MAX_TOKENS)  # the bits tell


def kv_worker(pair):  # noqa: F811
    """A serial worker (`serve --parallel 1`) whose target and draft K/V are 4-bit."""
    target, draft, tokenizer = pair
    kv = KVQuantization(4, GROUP)
    engine = Engine(target, ModelDrafter(draft, TINY_VOCAB), eos_ids=tokenizer.eos_token_ids, kv=kv, draft_kv=kv)
    return Worker(engine, tokenizer, gamma="2", parallel=1, cache_budget=2**28)


def test_a_serial_worker_answers_a_prompt_the_same_first_or_after_another(pair):  # noqa: F811
    """`serve --kv-bits 4 --parallel 1`: a job after another whose cache it reuses (the first
    250 tokens) answers as the same job sent first."""
    first = {"prompt": LONG, "max_tokens": MAX_TOKENS}
    other = {"prompt": LONG[:250], "max_tokens": 4}
    alone = run_jobs(kv_worker(pair), [first])[0]
    after = run_jobs(kv_worker(pair), [other, first])[1]
    assert isinstance(alone[1], Done) and isinstance(after[1], Done)
    assert after[1].prefilled_target < len(LONG)  # the second job reused the first one's cache
    assert after[0] == alone[0]


def test_serve_parallel_1_answers_a_prompt_the_same_first_or_after_another(tiny_dirs, cost_cache):
    """Two fresh `serve --kv-bits 4 --parallel 1`: one is sent the prompt first, the other
    after a prompt it extends, whose cached K/V it reuses."""
    target, draft = tiny_dirs
    args = ["--model", target, "--draft-model", draft, "--gamma", "2", "--kv-bits", "4", "--kv-group-size", str(GROUP),
            "--parallel", "1"]
    story = "Once upon a time, in a small village by the sea, there lived " * 6
    answers = []
    for earlier in ([], [story]):
        server = Server(args, server_env(cost_cache))
        try:
            client = server.client()
            for prompt in earlier:
                client.completions.create(model=target, prompt=prompt, max_tokens=4, temperature=0)
            answer = client.completions.create(model=target, prompt=story + FOLLOW, max_tokens=MAX_TOKENS, temperature=0)
            answers.append((answer.choices[0].text, answer.usage.prompt_tokens_details))
        finally:
            server.stop()
        assert "Traceback" not in server.log, server.log
    assert answers[1][0] == answers[0][0]
    assert answers[1][1].cached_tokens > 0  # the second server's answer reused the cache
