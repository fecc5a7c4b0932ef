"""Suffix decoding across requests (issue 44) against plain decoding and the n-gram drafter,
on the embedded Gemma 3 270M (float32, greedy, auto γ from this machine's cost curve, a
fresh policy per request as `serve` makes one).

Workloads, as one server would see them, in this order (the suffix drafter's memory is the
one a server keeps: every earlier request of the run, in its default scope):
  repeat    three chat prompts, each answered, then sent again twice in new requests;
  editing   a chat session: the model writes a short file, then two turns each asking for
            the whole file again with one small change (the conversation so far in the
            prompt, so the n-gram drafter sees the earlier file too);
  ordinary  the committed prose prompts (`short`, `long`), nothing repeated.
Every request runs plain, n-gram and suffix back to back (the order rotating by request,
against a shared CPU's drift); outputs must be md5-identical. Ratios are decode tok/s
(prompt processing excluded), per request and by workload (sums of tokens over sums of
time), suffix / plain and suffix / n-gram; tokens per target forward beside them, which a
loaded machine does not blur.

    python bench/suffix.py --max-tokens 64
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402
from pairs import gemma270m, prompt_text  # noqa: E402

from mlx_spec.apps.runner import gamma_policy  # noqa: E402
from mlx_spec.core.engine import Engine  # noqa: E402
from mlx_spec.core.stats import Stats  # noqa: E402
from mlx_spec.drafters import NgramDrafter, SuffixDrafter  # noqa: E402

REPEAT_PROMPTS = (
    "List five facts about the Moon, one per line.",
    "Explain in a short paragraph what a hash table is.",
    "Write a haiku about autumn rain, then explain it in two sentences.",
)
FILE_REQUEST = ("Write a Python file `shapes.py` with a class Rectangle (width, height, area(), "
                "perimeter()) and a class Circle (radius, area(), perimeter()). Only the code.")
EDITS = ("Rename the class Rectangle to Box and print the whole file again. Only the code.",
         "Add a docstring to Circle.area and print the whole file again. Only the code.")
SENDS = 3  # each repeat prompt: the first time and two more


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--edit-tokens", type=int, default=160, help="answer tokens in the editing session")
    parser.add_argument("--out", default="suffix_gemma270m")
    args = parser.parse_args()

    loaded = gemma270m("float32")
    tokenizer = loaded.tokenizer
    eos = set(tokenizer.eos_token_ids)
    engines = {"plain": Engine(loaded.model, None, eos_ids=eos),
               "ngram": Engine(loaded.model, NgramDrafter(), eos_ids=eos),
               "suffix": Engine(loaded.model, SuffixDrafter(), eos_ids=eos)}

    def chat(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    rows = []

    def request(workload: str, name: str, prompt: list[int], max_tokens: int) -> list[int]:
        """One request on every engine (rotating who goes first); returns the answer's ids."""
        results = {}
        order = list(engines)
        k = len(rows) % len(order)
        for kind in order[k:] + order[:k]:
            engine = engines[kind]
            gamma = 0 if engine.drafter is None else gamma_policy("auto", engine, context=len(prompt))
            stats = Stats()
            tokens = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=max_tokens, stats=stats)
                      for t in r.tokens]
            results[kind] = (tokens, stats)
        md5 = {k: hashlib.md5(str(v[0]).encode()).hexdigest() for k, v in results.items()}
        row = {"workload": workload, "request": name, "prompt_tokens": len(prompt),
               "identical": len(set(md5.values())) == 1, "md5": md5["plain"]}
        for kind, (tokens, stats) in results.items():
            row[kind] = {"generated": stats.generated, "decode_s": stats.decode_time, "tps": stats.decode_tps,
                         "rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
                         "drafted_from": stats.drafted_from, "accepted_from": stats.accepted_from}
        row["suffix_vs_plain"] = row["suffix"]["tps"] / row["plain"]["tps"]
        row["suffix_vs_ngram"] = row["suffix"]["tps"] / row["ngram"]["tps"]
        rows.append(row)
        print(f"{workload:8s} {name:24s} plain {row['plain']['tps']:5.2f}  ngram {row['ngram']['tps']:5.2f}  "
              f"suffix {row['suffix']['tps']:5.2f} tok/s  suffix/plain {row['suffix_vs_plain']:.2f}  "
              f"suffix/ngram {row['suffix_vs_ngram']:.2f}  accepted from {row['suffix']['accepted_from']}  "
              f"{'identical' if row['identical'] else 'DIFFERENT'}", flush=True)
        return results["plain"][0]

    for send in range(SENDS):
        for i, question in enumerate(REPEAT_PROMPTS):
            request("repeat", f"q{i} send {send + 1}", chat([{"role": "user", "content": question}]), args.max_tokens)
    messages = [{"role": "user", "content": FILE_REQUEST}]
    for turn, edit in enumerate((None, *EDITS)):
        if edit is not None:
            messages.append({"role": "user", "content": edit})
        answer = request("editing", f"turn {turn + 1}", chat(messages), args.edit_tokens)
        text = tokenizer.decode([t for t in answer if t not in eos])
        messages.append({"role": "assistant", "content": text})
    for name in ("short", "long"):
        request("ordinary", name, list(tokenizer.encode(prompt_text(name))), args.max_tokens)

    summary = {}
    for workload in ("repeat", "editing", "ordinary"):
        chosen = [r for r in rows if r["workload"] == workload]
        if workload == "repeat":
            summary["repeat_first"] = _ratios([r for r in chosen if r["request"].endswith("send 1")])
            chosen = [r for r in chosen if not r["request"].endswith("send 1")]
        summary[workload] = _ratios(chosen)
    first = {r["request"].split()[0]: r["suffix"]["tps"] for r in rows if r["request"].endswith("send 1")}
    summary["repeat_vs_first_answer"] = {
        r["request"]: r["suffix"]["tps"] / first[r["request"].split()[0]]
        for r in rows if r["workload"] == "repeat" and not r["request"].endswith("send 1")}
    summary["all_identical"] = all(r["identical"] for r in rows)
    for name, ratios in summary.items():
        print(name, ratios)
    path = write_results(args.out, {"bench": "suffix", "args": vars(args), "summary": summary, "rows": rows})
    print(f"wrote {path}")


def _ratios(rows) -> dict:
    """Decode tok/s of each kind over the rows (tokens summed over time summed), and ratios."""
    kinds = ("plain", "ngram", "suffix")
    tps = {k: sum(r[k]["generated"] for r in rows) / sum(r[k]["decode_s"] for r in rows) for k in kinds}
    # tokens per target forward: what drafting saves, whatever the machine's load
    per_forward = {k: sum(r[k]["generated"] for r in rows) / sum(r[k]["rounds"] for r in rows) for k in kinds}
    return {**{f"{k}_tps": v for k, v in tps.items()}, "suffix_vs_plain": tps["suffix"] / tps["plain"],
            "suffix_vs_ngram": tps["suffix"] / tps["ngram"], "ngram_vs_plain": tps["ngram"] / tps["plain"],
            **{f"{k}_tokens_per_forward": v for k, v in per_forward.items()}}


if __name__ == "__main__":
    main()
