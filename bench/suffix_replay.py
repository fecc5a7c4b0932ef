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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("record", "replay"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--edit-tokens", type=int, default=160)
    parser.add_argument("--out", default="suffix_replay_gemma270m")
    args = parser.parse_args()
    mx.random.seed(0)
    if args.step == "record":
        record(args.max_tokens, args.edit_tokens)
    else:
        replay(args.out)


if __name__ == "__main__":
    main()
