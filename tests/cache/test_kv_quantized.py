"""Quantized KV caches (`--kv-bits`): exact speculation on them, sliding-window layers and
Gemma 4's KV-shared layers included.

References: mlx-lm's own `generate_step(kv_bits=, kv_group_size=, quantized_kv_start=)` loop
(its prefill, switch and decoding, no drafting) run on our cache layers, whose global layers
quantize keys by channel (`ChannelQuantizedKVCache`; tests/cache/test_kv_channel.py.py checks that
layout against an independent reference), for every drafter and γ past the 16-token window
and past a key group; our plain decoding (γ = 0) with the same kv-bits; mlx-lm's
`QuantizedKVCache` for the exact distribution of the χ² check, and the cache's arrays
before a round for rollback.
"""

import mlx.core as mx
import numpy as np
import pytest
from cli_support import assert_usage_error, invoke, invoke_json
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from server_support import server_env, serving
from distribution_support import PARAMS, VOCAB, chi_square, exact_joint, sampled_joint
from distribution_support import PROMPT as SHORT_PROMPT
from trees_support import LONG_BRANCHING, SecondSiblingDrafter, flat_policy

from mlx_spec.cache.attention import quantized_attention
from mlx_spec.cache.global_layers import ChannelKeys, ChannelQuantizedKVCache
from mlx_spec.cache.layer_base import PackedKV
from mlx_spec.cache.layers import KVQuantization, QuantizedKVReader, make_cache
from mlx_spec.cache.sequence import SequenceCache, _fork_layer
from mlx_spec.cache.window_layers import QuantizedWindowKVCache
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.drafters.mtp import MtpDrafter
from mlx_spec.loading import load_pair
from mlx_spec.testing.tiny import perturbed_copy, tiny_gemma3
from mlx_spec.testing.tiny_gemma4 import save_tiny_assistant, save_tiny_gemma4, tiny_gemma4

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

WINDOW = 16  # the tiny models' sliding window
PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(40)]  # past the window
MAX_TOKENS = 40
GROUP = 32  # the tiny models' head size is 32 (64 on Gemma 4's full layers)
KV_FLAGS = ["--kv-group-size", str(GROUP)]
CHI_DRAWS = 600


def run(engine, prompt=PROMPT, gamma=0, max_tokens=MAX_TOKENS, **kwargs):
    return [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, **kwargs) for t in r.tokens]


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
    K/V, its decode loop: no drafting) run on our cache layers (`make_cache`)."""
    steps = generate_step(mx.array(prompt), SharedLayersRead(model), max_tokens=max_tokens,
                          prompt_cache=make_cache(model, slack=4), kv_bits=kv.bits,
                          kv_group_size=kv.group_size, quantized_kv_start=kv.start)
    return [token for token, _ in steps]


@pytest.mark.parametrize("arch,bits,start", [("gemma3", 8, 0), ("gemma3", 4, 0), ("gemma3", 4, 50),
                                             ("gemma4", 4, 0), ("gemma4", 8, 45)])  # 45, 50: mid-generation
def test_plain_quantized_decoding_is_mlx_lm_s_loop_on_our_caches(arch, bits, start):
    model = tiny_gemma3(seed=0) if arch == "gemma3" else tiny_gemma4(seed=0)
    reference = mlx_lm_decoding(model, KVQuantization(bits, GROUP, start))
    assert run(Engine(model, None, kv=KVQuantization(bits, GROUP, start))) == reference
    if bits == 4:  # the check has power: full precision decodes otherwise
        assert run(Engine(model, None)) != reference


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("heads,rows,mask", [(4, 1, None), (4, 3, "causal"), (2, 3, "bool"), (4, 3, "additive"),
                                             (1, 3, "causal")])
def test_quantized_attention_is_mlx_lm_s_bit_for_bit(bits, heads, rows, mask):
    """Query heads folded into rows (the Gemma 3 270M's 4 on 1 KV head, the tiny models' 2)
    give mlx-lm's quantized attention exactly, for each kind of mask mlx-lm passes."""
    B, keys_seen, D = 2, 70, 64
    queries = mx.random.normal((B, heads, rows, D), key=mx.random.key(1))
    k, v = (mx.random.normal((B, 1, keys_seen, D), key=mx.random.key(i)) for i in (2, 3))
    q_keys, q_values = (tuple(mx.quantize(x, group_size=GROUP, bits=bits)) for x in (k, v))
    causal = mx.arange(keys_seen - rows, keys_seen)[:, None] >= mx.arange(keys_seen)[None]
    mask = {"bool": causal & (mx.arange(keys_seen)[None] % 5 != 0),
            "additive": mx.random.normal((B, 1, rows, keys_seen), key=mx.random.key(4))}.get(mask, mask)
    reference = quantized_scaled_dot_product_attention(queries * 1, q_keys, q_values, 0.125, mask, GROUP, bits)
    ours = quantized_attention(queries, PackedKV(q_keys), PackedKV(q_values), 0.125, mask, GROUP, bits)
    assert np.array_equal(np.array(ours), np.array(reference))


def test_quantized_caches_hand_attention_their_packed_kv():
    cache = filled(tiny_gemma3(seed=0), KVQuantization(8, GROUP), PROMPT)  # past the window
    new = mx.zeros((1, 1, 2, 32))
    fetched = [layer.update_and_fetch(new, new) for layer in cache.cache]
    assert {type(c) for c in cache.cache} == {ChannelQuantizedKVCache, QuantizedWindowKVCache}
    assert all(isinstance(values, PackedKV) for _, values in fetched)
    assert {type(keys) for keys, _ in fetched} == {PackedKV, ChannelKeys}


@pytest.fixture(scope="module")
def gemma3_pair():
    target = tiny_gemma3(seed=0)
    return target, perturbed_copy(target, noise=0.02, seed=1)


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvq-mtp")
    save_tiny_gemma4(root / "target")
    save_tiny_assistant(root / "assistant")
    return load_pair(str(root / "target"), str(root / "assistant"), dtype="float32", progress=False)


def engines(kind, gemma3_pair, mtp_pair, kv):
    """(plain engine, speculative engine) of one drafter kind, both with `kv`."""
    if kind == "mtp":
        target = mtp_pair.target.model
        drafter = MtpDrafter(mtp_pair.draft.model, target)
    else:
        target, draft = gemma3_pair
        drafter = ModelDrafter(draft, target.args.vocab_size) if kind == "model" else NgramDrafter(min_ngram=1)
    return Engine(target, None, kv=kv), Engine(target, drafter, kv=kv, draft_kv=kv)


@pytest.mark.parametrize("kind,bits,start", [
    ("ngram", 8, 0), ("ngram", 4, 45), ("model", 4, 0), ("model", 8, 45), ("mtp", 8, 0), ("mtp", 4, 45),
    *(pytest.param(*case, marks=pytest.mark.slow)
      for case in (("ngram", 4, 0), ("model", 8, 0), ("mtp", 4, 0), ("ngram", 8, 45), ("model", 4, 45), ("mtp", 8, 45))),
])  # start 45: some rounds would straddle the switch to quantized K/V
def test_speculative_greedy_equals_plain_decoding_with_the_same_kv_bits(kind, bits, start, gemma3_pair, mtp_pair):
    kv = KVQuantization(bits, GROUP, start)
    plain, spec = engines(kind, gemma3_pair, mtp_pair, kv)
    reference = mlx_lm_decoding(plain.target, kv)
    assert run(plain) == reference
    assert len(PROMPT) + len(reference) > 2 * WINDOW and len(PROMPT) + len(reference) > 2 * GROUP
    for gamma in (1, 4):
        assert run(spec, gamma=gamma) == reference, gamma
    cache = spec.make_prompt_cache()
    run(spec, gamma=3, prompt_cache=cache)
    assert cache.target.quantized and all(hasattr(c, "bits") for c in cache.target.cache)
    if kind == "model":
        assert cache.draft.quantized


def test_trees_on_quantized_caches_equal_plain_decoding(gemma3_pair):
    """Tree rows move into place in the packed arrays too (an accepted path off the block
    prefix, far past the window), and the n-gram drafter's branching trees stay exact."""
    target, _ = gemma3_pair
    kv = KVQuantization(4, GROUP)
    reference = run(Engine(target, None, kv=kv), LONG_BRANCHING, max_tokens=60)
    tree_engine = Engine(target, NgramDrafter(min_ngram=1), kv=kv)
    assert run(tree_engine, LONG_BRANCHING, flat_policy(max_gamma=4), 60) == reference
    prompt = [2, 40, 41, 42, 43, 44, 45, 40, 41]
    reference = run(Engine(target, None, kv=kv), prompt, max_tokens=80)
    engine = Engine(target, SecondSiblingDrafter(prompt, reference), kv=kv)
    assert run(engine, prompt, flat_policy(max_gamma=3), 80) == reference


def filled(model, kv, ids, slack=4) -> SequenceCache:
    """A cache holding `ids`, quantized: the switch comes before the forward after the
    prefill, as mlx-lm's comes after the prefill."""
    cache = SequenceCache(model, slack, kv=kv)
    cache.prefill(ids[:-1])
    cache.forward(mx.array(ids[-1:]))
    cache.settle(ids[-1:])
    return cache


def held(cache: SequenceCache) -> list:
    """Per layer: (offset, {absolute position: its K/V components as numpy}); for a layer
    keeping keys by channel, (offset, its state's arrays) once the groups its next write
    would quantize are (on a copy)."""
    out = []
    for layer in cache.cache:
        if isinstance(layer, ChannelQuantizedKVCache):
            twin = _fork_layer(layer)
            twin.settled = None  # all it holds is settled: `cache` is
            twin.quantize_settled()
            out.append((layer.offset, [np.array(a) for _, a in tree_flatten(twin.state)]))
            continue
        start = getattr(layer, "start", 0)
        parts = [np.array(a) for kv in layer.state for a in (kv if isinstance(kv, tuple) else (kv,))]
        out.append((layer.offset, {start + i: [p[..., i, :] for p in parts] for i in range(layer.offset - start)}))
    return out


def assert_same_positions(after, before, retain, recomputed=False):
    """`recomputed`: the positions' K/V came from passes of other widths, whose float
    results may differ in the last bit (BLAS): scales and full-precision keys then match
    closely (tests/cache/test_kv_channel.py.py checks bit-identity with the same keys fed)."""
    for (offset_a, a), (offset_b, b) in zip(after, before):
        assert offset_a == offset_b
        if isinstance(a, list):  # the whole state
            assert len(a) == len(b)
            pairs = zip(a, b)
        else:
            common = set(a) & set(b)
            assert len(common) >= min(retain, offset_a)  # what the next query needs
            pairs = (pair for position in common for pair in zip(a[position], b[position]))
        for x, y in pairs:
            if recomputed and x.dtype != np.uint32:
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
            else:
                assert np.array_equal(x, y)


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_a_rejected_draft_leaves_the_quantized_cache_as_it_was(arch):
    model = tiny_gemma3(seed=0) if arch == "gemma3" else tiny_gemma4(seed=0)
    slack = 5
    cache = filled(model, KVQuantization(4, GROUP), PROMPT[:-1], slack)
    assert {type(c) for c in cache.cache} == {ChannelQuantizedKVCache, QuantizedWindowKVCache}
    for last in PROMPT[-1:] + list(range(60, 100)):  # drops old window slots too
        before = held(cache)
        cache.forward(mx.array([last, 7, 8, 9]))
        mx.eval([c.state for c in cache.cache])
        cache.settle([])  # every draft token rejected, and the round's own token dropped
        assert_same_positions(held(cache), before, WINDOW - 1 + slack)
        cache.forward(mx.array([last, 7]))
        cache.settle([last])  # one position kept: as if fed alone
        twin = cache.fork()
        twin.rollback(1)
        twin.forward(mx.array([last]))
        twin.settle([last])
        assert_same_positions(held(twin), held(cache), WINDOW - 1 + slack, recomputed=True)


def test_quantized_caches_restore_from_state_and_meta_state(gemma3_pair):
    target, _ = gemma3_pair
    cache = filled(target, KVQuantization(8, GROUP), PROMPT[:-1])
    restored = cache.fork()
    restored.cache = [type(c).from_state(c.state, c.meta_state) for c in cache.cache]
    assert all(isinstance(c, (ChannelQuantizedKVCache, QuantizedWindowKVCache)) for c in restored.cache)
    new = mx.array(PROMPT[-1:] + [5, 6])
    assert np.array_equal(np.array(restored.forward(new)), np.array(cache.forward(new)))


def test_memory_of_a_quantized_cache(gemma3_pair):
    """8-bit K/V with float32 scales and biases per 32 values: (1 + 8/32) / 4 of float32, but
    for the global layers' full-precision tail of keys (the positions past the last whole
    group: 41 % 32 here)."""
    target, _ = gemma3_pair
    sizes, layers = {}, None
    for bits in (None, 8, 4):
        cache = filled(target, KVQuantization(bits, GROUP) if bits else None, PROMPT)
        sizes[bits], layers = cache.nbytes, cache.cache
    globals_ = sum(isinstance(c, ChannelQuantizedKVCache) for c in layers)
    assert globals_ and cache.offset == len(PROMPT)
    tail_key_bytes = globals_ * (len(PROMPT) % GROUP) * target.args.num_key_value_heads * target.args.head_dim * 4
    for bits, per_float in ((8, (1 + 8 / GROUP) / 4), (4, (0.5 + 8 / GROUP) / 4)):
        assert sizes[bits] == pytest.approx(sizes[None] * per_float + tail_key_bytes)


def test_kv_start_keeps_the_first_tokens_in_full_precision(gemma3_pair):
    target, _ = gemma3_pair
    cache = SequenceCache(target, 4, kv=KVQuantization(8, GROUP, start=30))
    cache.prefill(PROMPT[:20])
    assert not cache.quantized and cache.draft_room() == 30 - 1 - 20
    cache.prefill(PROMPT[:40])  # quantized before the chunk that starts past 30 only
    assert not cache.quantized
    cache.forward(mx.array([1]))
    assert cache.quantized and isinstance(cache.cache[0], QuantizedWindowKVCache)
    cache.settle([1])
    cache.prefill(PROMPT[:10])  # a shorter conversation: full precision again, as a fresh one
    assert not cache.quantized and cache.ids == PROMPT[:10]


@pytest.mark.slow  # ~70 s on a 2-core CPU
def test_sampling_at_temperature_one_draws_the_quantized_targets_distribution():
    """χ² against the exact joint of the first two tokens under the target as mlx-lm's
    generate_step runs it with kv_bits on our cache layers: the prompt but its last token
    prefilled in full precision, then each layer's `to_quantized`, then the rest on those."""
    target = tiny_gemma3(seed=0, vocab_size=VOCAB, logit_scale=2.0)
    draft = tiny_gemma3(seed=9, vocab_size=VOCAB, logit_scale=2.0)
    bits, held = 4, len(SHORT_PROMPT) - 1

    def quantized_target(inputs):
        cache = make_cache(target, slack=4)
        target(inputs[:, :held], cache=cache)
        return target(inputs[:, held:], cache=[c.to_quantized(group_size=GROUP, bits=bits) for c in cache])

    kv = KVQuantization(bits, GROUP)
    engine = Engine(target, ModelDrafter(draft, VOCAB), kv=kv, draft_kv=kv)
    params = SamplingParams(**PARAMS)
    counts = sampled_joint(engine, params, 3, CHI_DRAWS)
    stat, critical = chi_square(counts, exact_joint(quantized_target, params))
    assert stat < critical
    # the check has power: the full-precision target's joint is another distribution
    assert chi_square(counts, exact_joint(target, params))[0] > critical


# ---------------------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------------------


def test_generate_with_kv_bits_is_exact_for_every_drafter(tiny_dirs):
    target, draft = tiny_dirs
    texts = {}
    for bits, start in (("8", "0"), ("4", "12")):
        flags = ["--model", target, "--draft-model", draft, "--kv-bits", bits, "--kv-start", start,
                 "--draft-kv-bits", "8", *KV_FLAGS]
        texts[bits] = {
            (drafter, gamma): invoke_json(["generate", "Hello there", *flags, "-n", MAX_TOKENS, "--raw",
                                           "--drafter", drafter, "--gamma", gamma])["text"]
            for drafter, gamma in [("none", "0"), ("model", "1"), ("model", "4"), ("ngram", "3")]
        }
        assert len(set(texts[bits].values())) == 1, texts[bits]
    full = invoke_json(["generate", "Hello there", "--model", target, "-n", MAX_TOKENS, "--raw", "--drafter", "none"])
    assert full["text"] != texts["4"][("none", "0")]  # the flag changes what the target computes


@pytest.mark.parametrize("args,fragment", [
    (["--kv-bits", "5"], "--kv-bits must be 8 or 4"),
    (["--draft-kv-bits", "2"], "--draft-kv-bits must be 8 or 4"),
    (["--kv-bits", "8", "--kv-group-size", "48"], "--kv-group-size must be one of 32, 64, 128"),
    (["--kv-bits", "8", "--kv-start", "-1"], "--kv-start must be 0 or more"),
    (["--kv-start", "100"], "add --kv-bits"),
    (["--kv-bits", "8"], "--kv-group-size 64 does not divide the model's head size (32): choose 32"),
])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_bad_kv_values_are_one_line_errors(tiny_dirs, command, args, fragment):
    words = ["generate", "Hi"] if command == "generate" else ["bench"]
    assert_usage_error(invoke([*words, "--model", tiny_dirs[0], "-n", "2", *args]), fragment)


def test_bench_with_kv_bits_checks_exactness(tiny_dirs):
    target, draft = tiny_dirs
    out = invoke_json(["bench", "--model", target, "--draft-model", draft, "--gamma", "2", "--runs", "1", "--prompt", "Hello there",
                       "-n", "24", "--kv-bits", "4", *KV_FLAGS])
    assert out["ok"] and out["identity_checked"] and out["settings"]


def answers(stdout: str) -> list[str]:
    """The chat command's answers, without their statistics footers."""
    return [turn.split("\n[")[0] for turn in stdout.split(">>> ")[1:] if "\n[" in turn]


def test_chat_with_kv_bits_is_exact(tiny_dirs):
    target, draft = tiny_dirs
    script = "Hello there, how are you today?\nTell me about the sea and the ships.\n"
    flags = ["--model", target, "--draft-model", draft, "-n", "24", "--kv-bits", "4", *KV_FLAGS]
    plain = invoke(["chat", *flags, "--drafter", "none"], input=script)
    spec = invoke(["chat", *flags, "--gamma", "3"], input=script)
    assert plain.exit_code == spec.exit_code == 0, (plain.stderr, spec.stderr)
    assert len(answers(plain.stdout)) == 2 and answers(spec.stdout) == answers(plain.stdout)


@pytest.fixture(scope="module")
def kv_server(tiny_dirs, cost_cache):
    target, draft = tiny_dirs
    yield from serving(["--model", target, "--draft-model", draft, "--gamma", "3", "--kv-bits", "8",
                        *KV_FLAGS], server_env(cost_cache))


def test_serve_with_kv_bits_answers_as_plain_decoding(kv_server, tiny_dirs):
    messages = [{"role": "user", "content": "Tell me a long story about the sea"}]
    answer = kv_server.client().chat.completions.create(model=tiny_dirs[0], messages=messages,
                                                        max_tokens=MAX_TOKENS, temperature=0)
    cli = invoke_json(["generate", messages[0]["content"], "--chat", "-n", MAX_TOKENS, "--temp", 0,
                       "--model", tiny_dirs[0], "--drafter", "none", "--kv-bits", "8", *KV_FLAGS])
    assert answer.choices[0].message.content == cli["text"]
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens > 2 * WINDOW
    assert answer.model_extra["mlx_spec"]["drafted"] > 0


def test_batched_mtp_rows_on_quantized_caches_equal_plain_decoding(gemma3_pair, mtp_pair):
    """Two MTP rows in one batch over 4-bit target K/V (packed: each row's assistant steps
    and target passes run alone, still in the batch's rounds): each answer is plain
    decoding with the same kv-bits."""
    from batch_support import batched

    plain, spec = engines("mtp", gemma3_pair, mtp_pair, KVQuantization(4, GROUP))
    prompts = [PROMPT, PROMPT[:20]]
    requests = [spec.for_request().rounds(p, gamma=3, max_tokens=MAX_TOKENS, batched=True) for p in prompts]
    out = {rounds: [] for rounds in requests}
    assert max(batched(requests, [0, 0], out)) == 2
    assert [out[rounds] for rounds in requests] == [run(plain, prompt=p) for p in prompts]
