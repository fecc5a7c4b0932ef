"""Where a decode step's time goes with a quantized KV cache (--kv-bits 8 / 4) at a long
context, on the embedded Gemma 3 270M (float32, MKL): issue 29 asks for ≥ 0.9× full
precision at 8k tokens.

    python bench/kv_decode_profile.py [--context 8192] [--runs 5]

1. Whole decode steps (one token: forward, argmax, settle) from caches holding `--context`
   positions, with and without the LM head, full / 8-bit / 4-bit, interleaved, one warm-up
   run each, medians. The caches hold random K/V (a step's time depends on shapes only), so
   no 8k prefill is needed.
2. The same step's parts, in isolation at the model's shapes (4 query heads on 1 KV head,
   head_dim 256; a sliding-window layer attends to 512 keys, a global one to `--context`):
   attention as mlx-lm runs it (full precision: `mx.fast.scaled_dot_product_attention`;
   quantized: `quantized_scaled_dot_product_attention`, keys per position), ours on
   per-position keys (`quantized_attention`, the window layers') and on keys by channel
   (`channel_attention`, the global layers': K^T quantized in groups of positions per
   channel, `ChannelQuantizedKVCache`), their quantized matmuls alone next to the float32
   matmuls (MKL's sgemm) they replace, and a cache layer's write of one position.
3. The model: 15 window layers (per-position keys) and 3 global ones (keys by channel),
   each costing its attention and write, predicts the quantized steps' extra time; set
   against the measured difference.

Writes bench/results/kv_decode_profile.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx_spec  # noqa: F401,E402  (before mlx.core: it loads the optimised BLAS)
import mlx.core as mx  # noqa: E402
from common import OtherLoad, median, write_results  # noqa: E402  (imports mlx_spec first: the BLAS)

from mlx_spec.core.cache.attention import channel_attention, quantized_attention  # noqa: E402

# mlx-lm's own quantized attention (mlx_spec.runtime routes mlx-lm's module global to ours)
from mlx_spec.core.cache.attention import mlx_lm_quantized_attention as quantized_scaled_dot_product_attention  # noqa: E402
from mlx_spec.core.cache.global_layers import ChannelKeys, quantize_by_channel  # noqa: E402
from mlx_spec.core.cache.layers import KVQuantization  # noqa: E402
from mlx_spec.core.cache.sequence import SequenceCache  # noqa: E402
from mlx_spec.core.cache.window_layers import WindowKVCache  # noqa: E402

SLACK = 8
GROUP = 64
# What our global layers store: K^T quantized along positions, groups of GROUP positions per
# channel, which lets the scores use the non-transposed kernel (as p @ V does)
KEYS_BY_CHANNEL = "scores q @ K^T, K^T quantized along positions (transpose=False: our global layers)"
PER_POSITION_SCORES = "scores q @ K^T (mx.quantized_matmul, transpose=True: keys per position)"
SETTINGS = {"full": None, "8-bit": KVQuantization(8, GROUP), "4-bit": KVQuantization(4, GROUP)}


def filled(model, kv, context: int) -> SequenceCache:
    """A cache holding `context` random positions on every layer, switched as --kv-bits
    switches it after a prefill."""
    args = model.args
    sequence = SequenceCache(model, SLACK, kv=kv)
    for layer in sequence.cache:
        for begin in range(0, context, 512):  # as a prefill's chunks fill it
            n = min(512, context - begin)
            layer.update_and_fetch(*(mx.random.normal((1, args.num_key_value_heads, n, args.head_dim))
                                     for _ in range(2)))
            mx.eval(layer.keys, layer.values)
    sequence.ids = [2] * context
    sequence._quantize_when_due()
    mx.eval([layer.state for layer in sequence.cache])
    return sequence


def step_seconds(sequence: SequenceCache, tokens: int, head: bool) -> float:
    """Seconds per decode step over `tokens` steps (forked: every run starts alike)."""
    sequence = sequence.fork()
    token = mx.array([7])
    start = time.perf_counter()
    for _ in range(tokens):
        if head:
            token = mx.argmax(sequence.forward(token)[-1])[None]
            mx.eval(token)
        else:  # `forward` without its LM head
            sequence._quantize_when_due()
            sequence.unsettled += 1
            mx.eval(sequence._call(token[None], head=False))
        sequence.settle([7])
    return (time.perf_counter() - start) / tokens


def timed(make, repeats: int) -> float:
    """Median microseconds of evaluating make() (three warm-up calls first)."""
    for _ in range(3):
        mx.eval(make())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(make())
        times.append(time.perf_counter() - start)
    return median(times) * 1e6


def attention_parts(keys_seen: int, heads: int, kv_heads: int, dim: int, repeats: int) -> dict:
    """Microseconds of one decode row's attention over `keys_seen` keys, by part."""
    q = mx.random.normal((1, heads, 1, dim))
    k, v = (mx.random.normal((1, kv_heads, keys_seen, dim)) for _ in range(2))
    rows = q.reshape(1, kv_heads, heads // kv_heads, dim)  # the query heads sharing a KV head
    probs = mx.softmax(mx.random.normal((1, kv_heads, heads // kv_heads, keys_seen)), axis=-1)
    scale = dim ** -0.5
    mx.eval(q, k, v, rows, probs)
    out = {"full precision": {
        "attention (mx.fast.scaled_dot_product_attention)": timed(
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None), repeats),
        "scores q @ K^T (float32 matmul, MKL sgemm)": timed(lambda: rows @ k.swapaxes(-1, -2), repeats),
        "weighted values p @ V (float32 matmul)": timed(lambda: probs @ v, repeats),
        "softmax": timed(lambda: mx.softmax(probs, axis=-1, precise=True), repeats)}}
    for bits in (8, 4):
        qk, qv = (mx.quantize(x, group_size=GROUP, bits=bits) for x in (k, v))
        whole = keys_seen - keys_seen % GROUP  # whole groups of positions
        keys_t = quantize_by_channel(k[..., :whole, :], GROUP, bits)
        by_channel = ChannelKeys(keys_t, k[..., whole:, :], None, GROUP, bits)  # the rest: the tail
        mx.eval(qk, qv, keys_t)
        out[f"{bits}-bit"] = {
            "attention (mlx-lm quantized_scaled_dot_product_attention)": timed(
                lambda: quantized_scaled_dot_product_attention(q * 1, qk, qv, scale, None, GROUP, bits), repeats),
            "attention (ours: quantized_attention, query heads as rows)": timed(
                lambda: quantized_attention(q, qk, qv, scale, None, GROUP, bits), repeats),
            "attention (ours: channel_attention, keys by channel)": timed(
                lambda: channel_attention(q, by_channel, qv, scale, None, GROUP, bits), repeats),
            PER_POSITION_SCORES: timed(
                lambda: mx.quantized_matmul(rows, *qk, transpose=True, group_size=GROUP, bits=bits), repeats),
            "weighted values p @ V (mx.quantized_matmul, transpose=False)": timed(
                lambda: mx.quantized_matmul(probs, *qv, transpose=False, group_size=GROUP, bits=bits), repeats),
            KEYS_BY_CHANNEL: timed(
                lambda: mx.quantized_matmul(rows, *keys_t, transpose=False, group_size=GROUP, bits=bits), repeats)}
    return out


def write_parts(layer, kv_heads: int, dim: int, repeats: int) -> float:
    """Microseconds for a cache layer to take one new position's K and V (and roll it back)."""
    new = [mx.random.normal((1, kv_heads, 1, dim)) for _ in range(2)]
    mx.eval(new)

    def write():
        seen = layer.update_and_fetch(*new)
        layer.trim(1)
        return seen
    return timed(write, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8, help="decode steps per run")
    args = parser.parse_args()

    from mlx_spec.loading import load_model

    model = load_model(None, dtype="float32", progress=False).model
    config = model.args
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    caches = {name: filled(model, kv, args.context) for name, kv in SETTINGS.items()}
    window_layers = sum(isinstance(c, WindowKVCache) for c in caches["full"].cache)
    global_layers = len(caches["full"].cache) - window_layers
    load = OtherLoad()

    # 1. whole steps, interleaved
    steps = {}
    for head in (True, False):
        times = {name: [] for name in SETTINGS}
        for run in range(args.runs + 1):  # run 0: warm-up
            for name in SETTINGS:
                seconds = step_seconds(caches[name], args.tokens, head)
                if run:
                    times[name].append(seconds)
        label = "with LM head" if head else "layers only (no LM head)"
        steps[label] = {name: {"ms": median(v) * 1e3, "runs_ms": [t * 1e3 for t in v],
                               "speed_vs_full": median(times["full"]) / median(v)} for name, v in times.items()}
        print(label, {k: f"{v['ms']:.1f} ms ({v['speed_vs_full']:.2f}×)" for k, v in steps[label].items()}, flush=True)

    # 2. the parts, at the model's shapes
    repeats = 30
    parts = {"window layer": {"keys_seen": config.sliding_window,
                              **attention_parts(config.sliding_window, heads, kv_heads, dim, repeats * 5)},
             "global layer": {"keys_seen": args.context,
                              **attention_parts(args.context, heads, kv_heads, dim, repeats)}}
    window_cache = {name: next(c for c in caches[name].fork().cache if isinstance(c, WindowKVCache))
                    for name in SETTINGS}
    global_cache = {name: next(c for c in caches[name].fork().cache if not isinstance(c, WindowKVCache))
                    for name in SETTINGS}
    writes = {kind: {name: write_parts(layer[name], kv_heads, dim, repeats * 5) for name in SETTINGS}
              for kind, layer in (("window layer", window_cache), ("global layer", global_cache))}
    for kind in parts:
        parts[kind]["write one position (update_and_fetch + trim)"] = writes[kind]
    print({k: {s: {p: round(t) for p, t in v.items()} if isinstance(v, dict) else v for s, v in d.items()}
           for k, d in parts.items()}, flush=True)

    # 3. the model of a step's extra time, against the measured one
    def attention_us(kind, name):
        if name == "full":
            return parts[kind]["full precision"]["attention (mx.fast.scaled_dot_product_attention)"]
        ours = "channel_attention, keys by channel" if kind == "global layer" else "quantized_attention, query heads as rows"
        return parts[kind][name][f"attention (ours: {ours})"]

    model_ms = {}
    for name in SETTINGS:
        model_ms[name] = sum(count * (attention_us(kind, name) + writes[kind][name])
                             for kind, count in (("window layer", window_layers), ("global layer", global_layers))) / 1e3
    measured = steps["with LM head"]
    breakdown = {name: {"attention_and_writes_ms (model)": model_ms[name],
                        "extra_vs_full_ms (model)": model_ms[name] - model_ms["full"],
                        "extra_vs_full_ms (measured step)": measured[name]["ms"] - measured["full"]["ms"],
                        "global_layers_scores_extra_ms": global_layers * (
                            parts["global layer"][name][KEYS_BY_CHANNEL]
                            - parts["global layer"]["full precision"]["scores q @ K^T (float32 matmul, MKL sgemm)"]) / 1e3,
                        "global_layers_scores_saved_ms_by_channel (vs per-position keys)": global_layers * (
                            parts["global layer"][name][PER_POSITION_SCORES]
                            - parts["global layer"][name][KEYS_BY_CHANNEL]) / 1e3}
                 for name in SETTINGS if name != "full"}
    print(breakdown)
    print(write_results("kv_decode_profile", {
        "model": "Gemma 3 270M (embedded GGUF), float32", "context": args.context, "group_size": GROUP,
        "layers": {"window": window_layers, "global": global_layers, "sliding_window": config.sliding_window,
                   "query_heads": heads, "kv_heads": kv_heads, "head_dim": dim},
        "note": "measured under load (shared CPU); microseconds unless named ms",
        "other_cores_busy": load.cores(), "steps": steps, "parts_us": parts, "breakdown": breakdown}))


if __name__ == "__main__":
    main()
