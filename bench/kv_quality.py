"""What a quantized KV cache (--kv-bits 8 / 4) costs and saves on the embedded Gemma 3 270M
(real weights, float32, MKL): perplexity of a long text, top-1 agreement with the
full-precision cache, greedy agreement, KV memory and decode speed at 8k tokens.

    python bench/kv_quality.py [--ppl-tokens 2048] [--context 8192] [--runs 2] [--parts quality,memory]

The text is the repository's own: its English prose (the committed prompts, the perplexity
test's paragraph), then docs/*.md, cut to several 512-token windows.
- perplexity: the text fed in 256-token chunks through our caches (quantized K/V are
  quantized before attention, so every chunk sees what decoding would); top-1 agreement:
  positions whose argmax equals the full-precision cache's;
- greedy: 64 tokens greedily decoded after two prompts cut from the text (600 and 1500
  tokens), compared with full precision: identical leading tokens, and equal positions;
- memory at `--context` tokens: `nbytes` of both models' caches (target and a draft model
  of the same architecture, here the same weights: the target's cache copied), each filled
  once in full precision and switched as --kv-start switches it (the same classes and
  buffers: the global layers' keys by channel, a tail of < group size keys in full
  precision), float32 as measured, and the same caches cast to bfloat16 (a Mac's dtype)
  before quantizing;
- decode speed at `--context`: 16 plain greedy tokens from the filled cache (forked per
  run), full / 8-bit / 4-bit interleaved, one warm-up run each, medians.

Writes bench/results/kv_quality.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx_spec  # noqa: F401,E402  (before mlx.core: it loads the optimised BLAS)
import mlx.core as mx  # noqa: E402
from common import RESULTS, OtherLoad, median, write_results  # noqa: E402  (imports mlx_spec first: the BLAS)

from mlx_spec.core.cache.layers import KVQuantization  # noqa: E402
from mlx_spec.core.cache.sequence import PromptCache, SequenceCache  # noqa: E402
from mlx_spec.core.engine import Engine  # noqa: E402

ROOT = Path(__file__).parent.parent
# English prose first (the committed prompts, the perplexity test's paragraph), then the docs
TEXT_FILES = ["mlx_spec/prompts/window.txt", "mlx_spec/prompts/long.txt", "mlx_spec/prompts/quote.txt",
              "tests/data/english_paragraph.txt", "docs/design.md", "docs/models.md", "docs/performance.md",
              "docs/server.md", "docs/distributed.md"]
SLACK = 8
SETTINGS = {"full": None, "8-bit": KVQuantization(8), "4-bit": KVQuantization(4)}


def text_ids(tokenizer, n: int) -> list[int]:
    text = "\n\n".join((ROOT / f).read_text() for f in TEXT_FILES)
    ids = tokenizer.encode(text)
    while len(ids) < n:  # repeated if the docs run short of a long context
        ids = ids + ids[1:]
    return ids[:n]


def score(model, ids: list[int], kv, chunk: int = 256):
    """(negative log-likelihoods, argmax ids) of every next token of `ids`. The first token is
    fed alone: mlx-lm's switch to quantized K/V comes after the first forward."""
    cache = SequenceCache(model, SLACK, kv=kv)
    nll, top = [], []
    fed = ids[:-1]
    for first, end in [(0, 1)] + [(b, min(b + chunk, len(fed))) for b in range(1, len(fed), chunk)]:
        logits = cache.forward(mx.array(fed[first:end])).astype(mx.float32)
        cache.settle(fed[first:end])
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.array(ids[first + 1 : end + 1])
        chosen = mx.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        mx.eval(chosen)
        nll.extend((-chosen).tolist())
        top.extend(mx.argmax(logits, axis=-1).tolist())
    return nll, top


def greedy(model, prompt: list[int], kv, n: int = 64) -> list[int]:
    return [t for r in Engine(model, None, kv=kv).rounds(prompt, gamma=0, max_tokens=n) for t in r.tokens]


def leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cast_nbytes(cache: SequenceCache, kv) -> int:
    """The bytes `cache`'s K/V take in bfloat16, switched as --kv-bits `kv` switches them
    (None: not): a copy cast, then quantized by the same classes as in float32."""
    twin = cache.fork()
    for layer in twin.cache:
        layer.keys, layer.values = layer.keys.astype(mx.bfloat16), layer.values.astype(mx.bfloat16)
    twin.kv = kv
    twin._quantize_when_due()
    return twin.nbytes


WARM_UP = 3  # decode runs per setting before the timed ones


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--parts", default="quality,memory", help="quality (perplexity, greedy) and/or "
                        "memory (memory and decode speed at --context); results merge into the JSON")
    args = parser.parse_args()
    parts = set(args.parts.split(","))

    from mlx_spec.loading import load_model

    loaded = load_model(None, dtype="float32", progress=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    out = {"model": "Gemma 3 270M (embedded GGUF), float32", "text": TEXT_FILES,
           "group_size": 64, "kv_start": 0, "window": 512}

    if "quality" in parts:
        out.update(quality(model, tokenizer, args))
    if "memory" in parts:
        out.update(memory_and_speed(model, tokenizer, args))
    previous = RESULTS / "kv_quality.json"
    if previous.exists():  # the parts not run now stay as they were
        out = {**{k: v for k, v in json.loads(previous.read_text()).items() if k != "environment"}, **out}
    print(write_results("kv_quality", out))


def quality(model, tokenizer, args) -> dict:
    out = {}
    # 1. perplexity and top-1 agreement over the text
    ids = text_ids(tokenizer, args.ppl_tokens)
    scored = {name: score(model, ids, kv) for name, kv in SETTINGS.items()}
    full_top = scored["full"][1]
    out["perplexity"] = {"tokens": len(ids), **{
        name: {"perplexity": math.exp(sum(nll) / len(nll)),
               "top1_agreement": sum(a == b for a, b in zip(top, full_top)) / len(top)}
        for name, (nll, top) in scored.items()}}
    print("perplexity:", {k: round(v["perplexity"], 3) for k, v in out["perplexity"].items() if k != "tokens"})

    # 2. greedy decoding past several windows
    runs = []
    for cut in (600, 1500):
        prompt = ids[:cut]
        tokens = {name: greedy(model, prompt, kv) for name, kv in SETTINGS.items()}
        runs.append({"prompt_tokens": cut, **{
            name: {"leading_identical": leading_equal(t, tokens["full"]),
                   "equal_positions": sum(a == b for a, b in zip(t, tokens["full"])) / len(tokens["full"])}
            for name, t in tokens.items() if name != "full"}})
    out["greedy"] = {"tokens": 64, "runs": runs}
    print("greedy:", runs)
    return out


def memory_and_speed(model, tokenizer, args) -> dict:
    out = {}
    # 3. memory at the long context, both models' caches: each filled once in full precision,
    # then switched as --kv-start switches it (the same classes and buffers; values aside)
    long_ids = text_ids(tokenizer, args.context)
    full_cache = PromptCache(model, SLACK)
    full_cache.target.prefill(long_ids[:-1])
    full_cache.draft = full_cache.target.fork()  # the draft: the same architecture (and weights), as if prefilled
    memory, filled = {}, {}
    for name, kv in SETTINGS.items():
        cache = full_cache.fork()
        for sequence in (cache.target, cache.draft):
            sequence.kv = kv
            sequence._quantize_when_due()
        memory[name] = {"target_bytes": cache.target.nbytes, "draft_bytes": cache.draft.nbytes}
        filled[name] = cache
    full = memory["full"]
    for name, m in memory.items():
        m["ratio_target"] = m["target_bytes"] / full["target_bytes"]
        m["ratio_draft"] = m["draft_bytes"] / full["draft_bytes"]
    plain = filled["full"].target
    bf16_full = cast_nbytes(plain, None)
    out["memory"] = {"tokens": len(long_ids), "float32": memory,
                     "bfloat16": {name: {"target_bytes": cast_nbytes(plain, kv),
                                         "ratio": cast_nbytes(plain, kv) / bf16_full}
                                  for name, kv in SETTINGS.items()}}
    print("memory:", {k: round(v["ratio_target"], 3) for k, v in memory.items()},
          "bf16:", {k: round(v["ratio"], 3) for k, v in out["memory"]["bfloat16"].items()})

    # 4. decode speed at the long context, interleaved, medians
    n = 32
    times = {name: [] for name in SETTINGS}
    others = OtherLoad()
    for run in range(-WARM_UP, args.runs):  # the first runs of each are slower (warming up): untimed
        for name, kv in SETTINGS.items():
            cache = filled[name].fork()
            engine = Engine(model, None, kv=kv)
            start = time.perf_counter()
            tokens = [t for r in engine.rounds(long_ids, gamma=0, max_tokens=n, prompt_cache=cache) for t in r.tokens]
            elapsed = time.perf_counter() - start
            if run >= 0:
                times[name].append(len(tokens) / elapsed)
    speed = {name: {"tok_s": median(v), "runs": v} for name, v in times.items()}
    for name in speed:
        speed[name]["ratio"] = speed[name]["tok_s"] / speed["full"]["tok_s"]
    out["decode_speed"] = {"context": len(long_ids), "tokens": n, "other_load_cores": others.cores(), **speed}
    print("decode tok/s:", {k: round(v["tok_s"], 2) for k, v in speed.items()})
    return out


if __name__ == "__main__":
    main()
