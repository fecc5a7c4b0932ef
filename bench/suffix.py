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
against a shared CPU's drift), after one warm-up request each; outputs must be
md5-identical. Ratios are decode tok/s (prompt processing excluded), per request and by
workload (sums of tokens over sums of time), suffix / plain and suffix / n-gram; tokens per
target forward beside them, which a loaded machine does not blur. `never_loses` lists the
requests where suffix took more target forwards than n-gram, or fewer tok/s.

Then `serve` with default options (`--servers` fresh processes, one after the other, no
flags but --port): after a warm-up request, the repeat prompts through
/v1/chat/completions (streamed, greedy), each answered and then re-sent in new requests;
each answer's decode tok/s as the server measured it (the `mlx_spec` block: prefill
excluded, as issue 44 measured), and two wall-clock rates as the client sees them: from
the first streamed token to the last ((tokens - 1) / seconds: a round streams its tokens
together, so the first round's extra tokens count as free, which favours re-sent answers
by up to a round's worth) and end to end (tokens over the seconds from sending to the last
token: the prefill included, which a re-sent prompt finds cached). Ratios: each re-sent
answer over its own prompt's first answer in the same server, and their medians. The load (`uptime`) is
recorded before, between and after the parts.

    python bench/suffix.py --max-tokens 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
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
WARM_UP = "Name three colours."
BANNER = re.compile(r"at (http://\S+)/v1")


def uptime() -> str:
    """`uptime`'s line: the machine is shared, so every figure says how busy it was."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--edit-tokens", type=int, default=160, help="answer tokens in the editing session")
    parser.add_argument("--servers", type=int, default=2, help="fresh `serve` processes for the serve part")
    parser.add_argument("--sends", type=int, default=SENDS, help="times each prompt goes to each server")
    parser.add_argument("--part", choices=("engines", "serve", "both"), default="both")
    parser.add_argument("--out", default="suffix_gemma270m")
    args = parser.parse_args()
    load = {"start": uptime()}
    payload = {"bench": "suffix", "args": vars(args), "load": load}
    if args.part in ("engines", "both"):
        payload.update(engines_part(args))
        load["after_engines"] = uptime()
    if args.part in ("serve", "both"):
        payload["serve"] = serve_part(args, payload.get("plain_texts", {}))
    load["end"] = uptime()
    payload.pop("plain_texts", None)
    for line in load.values():
        print("load:", line)
    path = write_results(args.out, payload)
    print(f"wrote {path}")


def engines_part(args) -> dict:
    loaded = gemma270m("float32")
    tokenizer = loaded.tokenizer
    eos = set(tokenizer.eos_token_ids)
    engines = {"plain": Engine(loaded.model, None, eos_ids=eos),
               "ngram": Engine(loaded.model, NgramDrafter(), eos_ids=eos),
               "suffix": Engine(loaded.model, SuffixDrafter(), eos_ids=eos)}

    def chat(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    rows = []
    for engine in engines.values():  # warm-up: compiled kernels, the cost curve calibrated
        gamma = 0 if engine.drafter is None else gamma_policy("auto", engine, context=16)
        for _ in engine.rounds(chat([{"role": "user", "content": WARM_UP}]), gamma=gamma, max_tokens=8):
            pass
    plain_texts = {}

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
            answer = request("repeat", f"q{i} send {send + 1}", chat([{"role": "user", "content": question}]),
                             args.max_tokens)
            plain_texts[question] = tokenizer.decode([t for t in answer if t not in eos])
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
    summary["never_loses"] = {
        "more_forwards_than_ngram": [r["request"] for r in rows if r["suffix"]["rounds"] > r["ngram"]["rounds"]],
        "fewer_tps_than_ngram": [f"{r['workload']} {r['request']}: {r['suffix_vs_ngram']:.3f}"
                                 for r in rows if r["suffix_vs_ngram"] < 1.0],
        "fewer_tps_than_plain": [f"{r['workload']} {r['request']}: {r['suffix_vs_plain']:.3f}"
                                 for r in rows if r["suffix_vs_plain"] < 1.0]}
    for name, ratios in summary.items():
        print(name, ratios)
    return {"summary": summary, "rows": rows, "plain_texts": plain_texts}


def serve_part(args, plain_texts: dict) -> dict:
    """`serve` with default options, `args.servers` times: first answers and re-sent ones."""
    import httpx

    servers = []
    for index in range(args.servers):
        command = [sys.executable, "-m", "mlx_spec.cli", "serve", "--port", "0"]
        began = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ})
        try:
            url = None
            for line in proc.stderr:
                match = BANNER.search(line)
                if match:
                    url = match.group(1)
                    break
            if url is None:
                raise SystemExit("serve did not start")
            while True:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            started = time.perf_counter() - began
            answers = [dict(_stream_answer(url, WARM_UP, 16), request="warm-up")]
            for send in range(args.sends):
                for i, question in enumerate(REPEAT_PROMPTS):
                    answer = _stream_answer(url, question, args.max_tokens)
                    answer.update(request=f"q{i} send {send + 1}", prompt=i, send=send + 1)
                    answers.append(answer)
                    print(f"serve {index + 1} q{i} send {send + 1}: {answer['stats'].get('decode_tps', 0):5.2f} tok/s "
                          f"decode, {answer['wall_tps']:5.2f} wall, "
                          f"{answer['tokens']} tokens, {answer['stats'].get('target_forwards')} target forwards, "
                          f"accepted from {answer['stats'].get('accepted_from')}", flush=True)
            servers.append({"server": index + 1, "start_s": started, "load_after": uptime(), "answers": answers})
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    ratios = []
    for server in servers:
        answers = [a for a in server["answers"] if a["request"] != "warm-up"]
        first = {a["prompt"]: a for a in answers if a["send"] == 1}
        for a in answers:
            if a["send"] > 1:
                before = first[a["prompt"]]
                ratios.append({"server": server["server"], "request": a["request"],
                               "decode_vs_first": a["stats"]["decode_tps"] / before["stats"]["decode_tps"],
                               "wall_vs_first": a["wall_tps"] / before["wall_tps"],
                               "end_to_end_vs_first": a["end_to_end_tps"] / before["end_to_end_tps"],
                               "forwards": a["stats"].get("target_forwards"),
                               "first_forwards": first[a["prompt"]]["stats"].get("target_forwards")})
    texts = {}
    for server in servers:
        for a in server["answers"]:
            if a["request"] != "warm-up":
                texts.setdefault(REPEAT_PROMPTS[a["prompt"]], set()).add(a["text"])
    identical = all(len(v) == 1 for v in texts.values())
    same_as_plain = all(plain_texts.get(q) in (None, *v) and len(v) == 1 for q, v in texts.items())
    summary = {}
    for measure in ("decode_vs_first", "wall_vs_first", "end_to_end_vs_first"):
        values = [r[measure] for r in ratios]
        summary[measure] = {
            "median": statistics.median(values), "min": min(values), "max": max(values),
            "median_by_prompt": {f"q{i}": statistics.median(r[measure] for r in ratios
                                                             if r["request"].startswith(f"q{i} "))
                                 for i in range(len(REPEAT_PROMPTS))}}
    summary.update({
               "identical_across_sends_and_servers": identical, "same_as_plain_engine": same_as_plain,
               "drafter": servers[0]["answers"][-1]["stats"].get("drafter")})
    print("serve:", summary)
    return {"summary": summary, "ratios": ratios, "servers": servers}


def _stream_answer(url: str, question: str, max_tokens: int) -> dict:
    """One streamed chat completion: its text, tokens, wall-clock decode tok/s (tokens after
    the first over the seconds from the first to the last) and the `mlx_spec` block."""
    import httpx

    body = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, stats, usage, first, last = "", {}, {}, None, None
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    text += piece
            usage = chunk.get("usage") or usage
            stats = chunk.get("mlx_spec") or stats
    tokens = usage.get("completion_tokens", 0)
    wall = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else float("nan")
    end_to_end = tokens / (last - sent) if last is not None else float("nan")
    return {"text": text, "tokens": tokens, "wall_tps": wall, "end_to_end_tps": end_to_end,
            "first_token_s": (first or sent) - sent,
            "stats": {k: stats.get(k) for k in ("drafter", "gamma", "target_forwards", "generated", "decode_tps",
                                                "accepted_from", "drafted_from", "rounds") if k in stats}}


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
