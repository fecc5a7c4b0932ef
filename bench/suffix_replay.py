"""Model-free drafters replayed on the target's own greedy answers: how many target forwards
each would take, without running the target again.

At temperature 0 a draft token is accepted exactly when it is the target's next greedy
token, so given the answers plain decoding wrote (`record`, once: the embedded Gemma 3 270M,
float32, the workloads of bench/suffix.py), a drafter's rounds are known exactly for a γ
policy that does not read the clock: the accepted length is the draft's longest prefix that
agrees with the answer, and each round commits that plus one target token. Requests are
replayed in order, as one server sees them (the suffix drafter's memory holds every earlier
request of the run). Policies: fixed γ 1..6, and auto γ on the machine's cached cost curve
with acceptance learned live (`gamma_policy("auto", reproducible=True)`: what `serve`
does, less the clock).

    python bench/suffix_replay.py record     # the answers (minutes on our CPU)
    python bench/suffix_replay.py replay     # every drafter and policy (seconds)
    python bench/suffix_replay.py timed --requests "repeat q2 send 1" "ordinary long"

`timed` runs chosen requests for real again, n-gram and suffix alternating `--repeats`
times (after a warm-up), the suffix drafter's memory rebuilt each time from the recorded
answers of the requests before it (what a server's memory held then): medians of decode
tok/s and their ratio, with `uptime` before and after (a check of bench/suffix.py's
single runs on a shared machine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_results  # noqa: E402
from pairs import gemma270m, prompt_text  # noqa: E402
from suffix import EDITS, FILE_REQUEST, REPEAT_PROMPTS, SENDS  # noqa: E402

import mlx.core as mx  # noqa: E402

from mlx_spec.core.policy import FixedGamma  # noqa: E402

ANSWERS = RESULTS / "suffix_answers_gemma270m.json"


def record(max_tokens: int, edit_tokens: int) -> None:
    from mlx_spec.core.engine import Engine

    loaded = gemma270m("float32")
    tokenizer = loaded.tokenizer
    eos = set(tokenizer.eos_token_ids)
    plain = Engine(loaded.model, None, eos_ids=eos)

    def chat(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    requests = []

    def answer(workload, name, prompt, limit):
        tokens = [t for r in plain.rounds(prompt, gamma=0, max_tokens=limit) for t in r.tokens]
        requests.append({"workload": workload, "request": name, "prompt": prompt, "answer": tokens})
        print(workload, name, len(prompt), len(tokens), flush=True)
        return tokens

    for send in range(SENDS):
        for i, question in enumerate(REPEAT_PROMPTS):
            answer("repeat", f"q{i} send {send + 1}", chat([{"role": "user", "content": question}]), max_tokens)
    messages = [{"role": "user", "content": FILE_REQUEST}]
    for turn, edit in enumerate((None, *EDITS)):
        if edit is not None:
            messages.append({"role": "user", "content": edit})
        tokens = answer("editing", f"turn {turn + 1}", chat(messages), edit_tokens)
        messages.append({"role": "assistant", "content": tokenizer.decode([t for t in tokens if t not in eos])})
    for name in ("short", "long"):
        answer("ordinary", name, list(tokenizer.encode(prompt_text(name))), max_tokens)
    ANSWERS.write_text(json.dumps({"model": "gemma3-270m float32, greedy", "requests": requests}) + "\n")
    print(f"wrote {ANSWERS}")


def replay_request(drafter, policy, prompt: list[int], answer: list[int], curve=None) -> dict:
    """One request's rounds with `drafter` under `policy`, greedy, against the known answer;
    with a cost `curve`, the seconds its target forwards would take on it."""
    drafter.begin(prompt)
    done, rounds, drafted, accepted, seconds = 0, 0, 0, 0, 0.0
    while done < len(answer):
        gamma = min(policy.choose(), len(answer) - done - 1)
        draft = drafter.propose(gamma).tokens.tolist() if gamma > 0 else []
        n = 0
        while n < len(draft) and draft[n] == answer[done + n]:
            n += 1
        committed = answer[done : done + n + 1]
        policy.observe(len(draft), n)
        drafter.accept(committed)
        done += len(committed)
        rounds, drafted, accepted = rounds + 1, drafted + len(draft), accepted + n
        seconds += curve.verify_time(len(draft) + 1) if curve is not None else 0.0
    drafter.end()
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted, "generated": len(answer),
            "curve_s": seconds}


def replay(out: str) -> None:
    from mlx_spec.apps.runner import gamma_policy
    from mlx_spec.core.engine import Engine
    from mlx_spec.drafters import NgramDrafter, SuffixDrafter

    requests = json.loads(ANSWERS.read_text())["requests"]
    loaded = gemma270m("float32")
    engine = Engine(loaded.model, NgramDrafter(), eos_ids=set(loaded.tokenizer.eos_token_ids))

    def auto(context):  # serve's auto γ, seeded: from the cached curve, never the clock
        return gamma_policy("auto", engine, context=context, reproducible=True)

    # "suffix_counts": every occurrence's vote alike (SuffixDecoding's counts), as before the
    # latest occurrence outvoted the older ones
    drafters = {"ngram": NgramDrafter, "suffix": SuffixDrafter, "suffix_counts": lambda: SuffixDrafter(recency=1.0)}
    policies = {f"g{g}": (lambda g: lambda context: FixedGamma(g))(g) for g in range(1, 7)}
    policies["auto"] = auto
    results = {}
    for policy_name, make_policy in policies.items():
        for kind, cls in drafters.items():
            drafter = cls()  # one per run: the suffix drafter's memory is the run's
            rows = [{"request": f"{r['workload']} {r['request']}",
                     **replay_request(drafter, make_policy(len(r["prompt"])), r["prompt"], r["answer"],
                                      auto(len(r["prompt"])).costs)}
                    for r in requests]
            results.setdefault(policy_name, {})[kind] = rows
    table, losses, totals = {}, {"suffix": [], "suffix_counts": []}, {}
    for policy_name, kinds in results.items():
        per = {}
        for i, r in enumerate(requests):
            name = f"{r['workload']} {r['request']}"
            per[name] = {kind: kinds[kind][i]["rounds"] for kind in drafters}
            for kind in losses:
                if per[name][kind] > per[name]["ngram"]:
                    losses[kind].append(f"{policy_name} {name}: {kind} {per[name][kind]} forwards, "
                                        f"n-gram {per[name]['ngram']}")
        table[policy_name] = per
        totals[policy_name] = {kind: {"forwards": sum(row["rounds"] for row in rows),
                                      "drafted": sum(row["drafted"] for row in rows),
                                      "accepted": sum(row["accepted"] for row in rows),
                                      "curve_s": sum(row["curve_s"] for row in rows)}
                               for kind, rows in kinds.items()}
        line = "  ".join(f"{k.split()[-1] if k.startswith('ordinary') else k.replace(' send ', '/')}"
                         f" {v['ngram']}/{v['suffix']}" for k, v in per.items())
        print(f"{policy_name:5s} n-gram/suffix forwards: {line}")
        print("      totals " + "  ".join(f"{kind} {t['forwards']} forwards, {t['curve_s']:.1f} s on the curve"
                                          for kind, t in totals[policy_name].items()))
    for kind, lost in losses.items():
        print(f"{kind} took more forwards than n-gram in {len(lost)} cases" + (":" if lost else ""))
        for loss in lost:
            print("  " + loss)
    digest = hashlib.md5(ANSWERS.read_bytes()).hexdigest()
    path = write_results(out, {"bench": "suffix_replay", "answers": ANSWERS.name, "answers_md5": digest,
                               "forwards": table, "totals": totals, "losses": losses, "rows": results})
    print(f"wrote {path}")


def timed(names: list[str], repeats: int, out: str) -> None:
    import statistics
    import subprocess

    from mlx_spec.apps.runner import gamma_policy
    from mlx_spec.core.engine import Engine
    from mlx_spec.core.stats import Stats
    from mlx_spec.drafters import NgramDrafter, SuffixDrafter
    from mlx_spec.drafters.token_memory import Memories

    def uptime() -> str:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    requests = json.loads(ANSWERS.read_text())["requests"]
    loaded = gemma270m("float32")
    eos = set(loaded.tokenizer.eos_token_ids)
    engines = {"ngram": Engine(loaded.model, NgramDrafter(), eos_ids=eos),
               "suffix": Engine(loaded.model, SuffixDrafter(memories=Memories(0)), eos_ids=eos)}
    load = {"start": uptime()}

    def run(kind: str, index: int, max_tokens: int) -> tuple[list[int], Stats]:
        engine, r = engines[kind], requests[index]
        if kind == "suffix":  # the memory a server held then: every earlier request, remembered
            memory = Memories().get()
            for earlier in requests[:index]:
                memory.remember(earlier["prompt"], earlier["answer"])
            engine = engine.for_request(memory=memory)
        stats = Stats()
        gamma = gamma_policy("auto", engine, context=len(r["prompt"]))
        tokens = [t for rnd in engine.rounds(r["prompt"], gamma=gamma, max_tokens=max_tokens, stats=stats)
                  for t in rnd.tokens]
        return tokens, stats

    for kind in engines:  # warm-up
        run(kind, 0, 8)
    results = {}
    for name in names:
        index = next(i for i, r in enumerate(requests) if f"{r['workload']} {r['request']}" == name)
        answer = requests[index]["answer"]
        runs = {"ngram": [], "suffix": []}
        for rep in range(repeats):
            for kind in (("ngram", "suffix") if rep % 2 == 0 else ("suffix", "ngram")):
                tokens, stats = run(kind, index, len(answer))
                assert tokens == answer, f"{name}: {kind} differs from plain decoding"
                runs[kind].append({"tps": stats.decode_tps, "rounds": stats.rounds})
        medians = {k: statistics.median(r["tps"] for r in v) for k, v in runs.items()}
        results[name] = {"runs": runs, "median_tps": medians, "suffix_vs_ngram": medians["suffix"] / medians["ngram"],
                         "rounds": {k: [r["rounds"] for r in v] for k, v in runs.items()}}
        print(f"{name}: n-gram {medians['ngram']:.2f}, suffix {medians['suffix']:.2f} tok/s (medians of {repeats}), "
              f"suffix/n-gram {results[name]['suffix_vs_ngram']:.2f}, rounds {results[name]['rounds']}", flush=True)
    load["end"] = uptime()
    print("load:", load)
    path = write_results(out, {"bench": "suffix_replay timed", "repeats": repeats, "load": load,
                               "identical": True, "requests": results})
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("record", "replay", "timed"))
    parser.add_argument("--requests", nargs="*", default=[], help="timed: the requests, as 'workload request'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--edit-tokens", type=int, default=160)
    parser.add_argument("--out", default="suffix_replay_gemma270m")
    args = parser.parse_args()
    mx.random.seed(0)
    if args.step == "record":
        record(args.max_tokens, args.edit_tokens)
    elif args.step == "timed":
        timed(args.requests, args.repeats, args.out if args.out != "suffix_replay_gemma270m" else "suffix_timed_gemma270m")
    else:
        replay(args.out)


if __name__ == "__main__":
    main()
