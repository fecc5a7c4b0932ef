"""Structured output on the embedded default (Gemma 3 270M, float32, the BLAS mlx_spec loads):
what the grammar's mask costs per token, and what drafting buys under it (issue 34).

Per-token mask overhead: along a generated address record, the time to compute the
grammar's mask for the next token and apply it to a row of logits (`Matcher.mask_after` +
`constrain`, evaluated), over the median decode step of plain unconstrained decoding.

Speedup: greedy decoding of an address record (fixed key names) under its JSON schema,
with drafting (n-gram prompt lookup at γ plus the grammar's forced runs as free drafts)
against constrained plain decoding (γ = 0, no forced drafts), interleaved, warm-up first,
medians; every run's tokens must be identical. The grammar-forced share is the committed
tokens that came as forced drafts.

    python bench/structured.py            # writes bench/results/structured.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlx_spec  # noqa: F401,E402  (before mlx.core: it loads the optimised BLAS)
import mlx.core as mx  # noqa: E402
from common import OtherLoad, median, spread, uptime, write_results  # noqa: E402

from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.grammar import compile_grammar, constrain, llg_tokenizer  # noqa: E402
from mlx_spec.core.sampling import SamplingParams  # noqa: E402
from mlx_spec.core.stats import Stats  # noqa: E402
from mlx_spec.drafters import NgramDrafter  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "street": {"type": "string", "maxLength": 60},
    "city": {"type": "string", "maxLength": 40}, "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
    "country": {"type": "string", "maxLength": 30}, "phone": {"type": "string", "maxLength": 20}},
    "required": ["name", "street", "city", "postal_code", "country", "phone"], "additionalProperties": False}
PROMPT = """Customer addresses, one JSON record per line:
{"name": "Anna Schmidt", "street": "12 Lindenstrasse", "city": "Berlin", "postal_code": "10115", "country": "Germany", "phone": "+49 30 1234567"}
{"name": "Pierre Martin", "street": "8 Rue de Rivoli", "city": "Paris", "postal_code": "75001", "country": "France", "phone": "+33 1 2345678"}
{"name": "John Smith", "street": "221 Baker Street", "city": "London", "postal_code": "12345", "country": "United Kingdom", "phone": "+44 20 7946000"}
"""


def run(engine, prompt_ids, grammar, gamma, max_tokens):
    stats = Stats()
    matcher = grammar.matcher(engine.eos_ids) if grammar is not None else None
    start = time.perf_counter()
    tokens = [t for r in engine.rounds(prompt_ids, SamplingParams(), gamma=gamma, max_tokens=max_tokens,
                                       stats=stats, constraint=matcher) for t in r.tokens]
    return tokens, stats, time.perf_counter() - start


def mask_times(grammar, eos_ids, tokens, width):
    """Seconds per token to compute the next mask along `tokens` and apply it to a logits row."""
    matcher, out = grammar.matcher(eos_ids), []
    row = mx.random.normal((1, width))
    mx.eval(row)
    for i in range(len(tokens)):
        matcher.masks.clear()  # as each round's new state: nothing cached
        start = time.perf_counter()
        mx.eval(constrain(row, matcher.mask_after(tokens[:0])[None]))
        out.append(time.perf_counter() - start)
        matcher.commit(tokens[i:i + 1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="structured")
    args = parser.parse_args()

    from mlx_spec.loading import load_model

    loaded = load_model(None, dtype="float32", progress=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    eos_ids = set(tokenizer.eos_token_ids)
    prompt_ids = list(tokenizer.encode(PROMPT))
    start = time.perf_counter()
    llg_tokenizer(tokenizer, eos_ids)  # once per tokenizer (a server builds it at start)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = compile_grammar(tokenizer, "json_schema", SCHEMA, eos_ids)
    compile_s = time.perf_counter() - start
    width = int(model(mx.array([[0]])).shape[-1])

    modes = {  # name -> (drafter, γ, grammar, forced drafts)
        "plain": (None, 0, None, False),
        "constrained_plain": (None, 0, grammar, False),
        "constrained_forced_only": (None, 0, grammar, True),
        "constrained_ngram": (NgramDrafter(), args.gamma, grammar, True),
    }
    results = {name: {"seconds": [], "tok_s": [], "step_ms": []} for name in modes}
    outputs, load, load_before = {}, OtherLoad(), uptime()
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
        for name in order:
            drafter, gamma, g, forced = modes[name]
            engine = Engine(model, drafter, eos_ids=eos_ids)
            engine.grammar_drafts = forced
            tokens, stats, seconds = run(engine, prompt_ids, g, gamma, args.max_tokens)
            if repeat == 0:
                continue
            outputs.setdefault(name, tokens)
            assert tokens == outputs[name], f"{name}: a run's tokens differ from its first"
            r = results[name]
            r["seconds"].append(seconds)
            r["tok_s"].append(stats.decode_tps)
            r["step_ms"].append(1e3 * stats.decode_time / max(stats.rounds, 1))
            r.update(tokens=len(tokens), rounds=stats.rounds, grammar_forced=stats.grammar_forced,
                     drafted=stats.drafted, accepted=stats.accepted)
    constrained = [outputs[n] for n in modes if n != "plain"]
    identical = all(t == constrained[0] for t in constrained)
    text = tokenizer.decode([t for t in constrained[0] if t not in eos_ids])
    masks = mask_times(grammar, eos_ids, constrained[0], width)
    step_ms = median(results["plain"]["step_ms"])
    summary = {name: {**{k: v for k, v in r.items() if k not in ("seconds", "tok_s", "step_ms")},
                      "tok_s_median": median(r["tok_s"]), "tok_s_spread": spread(r["tok_s"]),
                      "round_ms_median": median(r["step_ms"])} for name, r in results.items()}
    base = summary["constrained_plain"]["tok_s_median"]
    payload = {
        "schema": SCHEMA, "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens, "gamma": args.gamma,
        "llguidance_tokenizer_s": tokenizer_s, "compile_ms": 1e3 * compile_s,
        "mask_ms_median": 1e3 * statistics.median(masks),
        "decode_step_ms_median": step_ms,
        "mask_overhead": 1e3 * statistics.median(masks) / step_ms,
        # a constrained plain round cannot queue its successor before the sync (its mask
        # needs the token): the loop's pipelining is lost, not the mask's cost
        "constrained_plain_vs_plain_step": summary["constrained_plain"]["round_ms_median"] / step_ms,
        "speedup_ngram_vs_constrained_plain": summary["constrained_ngram"]["tok_s_median"] / base,
        "speedup_forced_only_vs_constrained_plain": summary["constrained_forced_only"]["tok_s_median"] / base,
        "grammar_forced_share": summary["constrained_ngram"]["grammar_forced"] / max(summary["constrained_ngram"]["tokens"], 1),
        "grammar_forced_share_forced_only": (summary["constrained_forced_only"]["grammar_forced"]
                                             / max(summary["constrained_forced_only"]["tokens"], 1)),
        "identical_outputs": identical, "output": text, "modes": summary,
        "other_cores_mean": load.cores(), "load_before": load_before, "load_after": uptime(),
        "note": "measured on a shared 2-core machine under load (load_before / load_after)",
    }
    for name, s in summary.items():
        print(f"{name:<24} {s['tok_s_median']:6.2f} tok/s  rounds {s['rounds']:3d}  forced {s['grammar_forced']:3d}")
    print(f"mask {payload['mask_ms_median']:.3f} ms / step {step_ms:.1f} ms = {100 * payload['mask_overhead']:.2f} %;"
          f" speedup {payload['speedup_ngram_vs_constrained_plain']:.2f}x; forced share "
          f"{payload['grammar_forced_share']:.2f}; identical {identical}")
    path = write_results(args.out, payload)
    print(f'{{"out": "{path}"}}')


if __name__ == "__main__":
    main()
