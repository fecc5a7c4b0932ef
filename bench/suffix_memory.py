"""The suffix drafter's own CPU cost per committed token, with ~1M tokens in its memory (issue 44:
"fast enough to be free"): update (the round's commit) plus lookup (the next round's
draft), plus remembering the request when it ends, over the committed tokens; beside the
same workload on Arctic Inference's C++ suffix tree where it can be imported.

The memory holds synthetic requests: Zipf-distributed tokens over Gemma's 262k vocabulary
(so frequent bigrams' chains are full, the lookup's worst case), a third of them an earlier
request re-sent with a few tokens changed (as agents do). Each measured request is one of
those texts again, decoded a few tokens a round (`--commit`), so drafts are found.

Arctic's tree (`arctic_inference.suffix_decoding._C.SuffixTree`) only builds with torch and
vLLM's toolchain; with `--arctic PATH`, a folder holding its compiled `_C` module is put on
sys.path and timed on the same tokens (global tree over the memory, a request tree over
the prompt and output, both looked up each round, as its `SuffixDecodingCache` does).

    python bench/suffix_memory.py --tokens 1000000 [--arctic /tmp/arctic_build]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np

from mlx_spec.drafters.suffix import SuffixDrafter
from mlx_spec.drafters.token_memory import Memories

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from common import RESULTS, environment, median  # noqa: E402

VOCAB = 262_144


def requests(total: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """Synthetic requests of `length` tokens adding up to `total`: Zipf-distributed, a third
    re-sent earlier ones with 1% of their tokens changed."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    while sum(r.size for r in out) < total:
        if out and rng.random() < 1 / 3:
            text = out[rng.integers(len(out))].copy()
            changed = rng.random(text.size) < 0.01
            text[changed] = rng.integers(VOCAB, size=int(changed.sum()))
        else:
            text = np.minimum(rng.zipf(1.1, size=length), VOCAB) - 1
        out.append(text.astype(np.int64))
    return out


def decode(speculate, commit, output: list[int], gamma: int) -> tuple[float, int, int]:
    """A greedy decode whose target writes `output`: each round drafts (`speculate(γ)`, a list
    of ids), keeps the draft's agreeing prefix and one more token (`commit(ids)`). Returns
    (CPU seconds in both, rounds, draft tokens accepted)."""
    spent, rounds, accepted, i = 0.0, 0, 0, 0
    while i < len(output):
        t0 = time.process_time()
        draft = speculate(gamma)
        n = 0
        while n < len(draft) and i + n < len(output) and draft[n] == output[i + n]:
            n += 1
        commit(output[i : i + n + 1])
        spent += time.process_time() - t0
        rounds, accepted, i = rounds + 1, accepted + n, i + n + 1
    return spent, rounds, accepted


def ours(memory_texts, measured: dict, prompt_len: int, gamma: int) -> dict:
    memories = Memories(tokens=len(np.concatenate(memory_texts)) + len(memory_texts) * 2)
    drafter = SuffixDrafter(memories)
    start = time.process_time()
    for text in memory_texts:
        drafter.memory.remember(text[:prompt_len].tolist(), text[prompt_len:].tolist())
    fill = time.process_time() - start
    out = {"memory_tokens": len(drafter.memory), "fill_s": fill, "fill_us_per_token": fill / len(drafter.memory) * 1e6}
    for workload, texts in measured.items():
        per_token, per_round, accepted, rounds = [], [], 0, 0
        for text in texts:
            prompt, output = text[:prompt_len].tolist(), text[prompt_len:].tolist()
            t0 = time.process_time()
            drafter.begin(prompt)
            begin_s = time.process_time() - t0
            spent, n_rounds, n_accepted = decode(lambda g: drafter.propose(g).tokens.tolist(), drafter.accept,
                                                 output, gamma)
            t0 = time.process_time()
            drafter.end()
            end_s = time.process_time() - t0
            per_token.append((begin_s + spent + end_s) / len(output))
            per_round.append(spent / n_rounds)
            accepted, rounds = accepted + n_accepted, rounds + n_rounds
        out[workload] = {"ms_per_committed_token": median(per_token) * 1e3, "runs_ms": [t * 1e3 for t in per_token],
                         "ms_per_round": median(per_round) * 1e3, "tokens_per_round": sum(len(t) - prompt_len for t in texts) / rounds}
    return out


def arctic(memory_texts, measured: dict, prompt_len: int, gamma: int, folder: str) -> dict:
    """Arctic's trees on the same decode: a global tree over earlier outputs (as its cache
    keeps them) and a request tree over the prompt and output, both matched every round,
    the higher-scoring draft taken (`SuffixDecodingCache.speculate`'s way)."""
    sys.path.insert(0, folder)
    from _C import SuffixTree  # noqa: E402  (Arctic's compiled module, built apart)

    depth = 32
    tree = SuffixTree(depth)
    start = time.process_time()
    for seq, text in enumerate(memory_texts):
        tree.extend(seq, text[prompt_len:].astype(np.int32).tolist())
    out = {"fill_s": time.process_time() - start}
    seq = len(memory_texts)
    for workload, texts in measured.items():
        per_token, rounds = [], 0
        for text in texts:
            prompt, output = text[:prompt_len].tolist(), text[prompt_len:].tolist()
            t0 = time.process_time()
            local = SuffixTree(depth)
            local.extend(0, prompt)
            context = list(prompt)
            begin_s = time.process_time() - t0

            def speculate(g):
                tail = context[-depth:]
                a = tree.speculate(tail, g, 1.0, 1.0, 0.1, False)
                b = local.speculate(tail, g, 1.0, 1.0, 0.1, False)
                return list((a if a.score >= b.score else b).token_ids)

            def commit(piece):
                local.extend(0, piece)
                tree.extend(seq, piece)
                context.extend(piece)

            spent, n_rounds, _ = decode(speculate, commit, output, gamma)
            per_token.append((begin_s + spent) / len(output))
            rounds += n_rounds
            seq += 1
        out[workload] = {"ms_per_committed_token": median(per_token) * 1e3, "runs_ms": [t * 1e3 for t in per_token],
                         "tokens_per_round": sum(len(t) - prompt_len for t in texts) / rounds}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--length", type=int, default=2000, help="tokens a request (prompt + output)")
    parser.add_argument("--prompt", type=int, default=500, help="of which prompt")
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--requests", type=int, default=9, help="measured requests")
    parser.add_argument("--arctic", help="a folder with Arctic Inference's compiled _C module")
    parser.add_argument("--out", default=str(RESULTS / "suffix_memory.json"))
    args = parser.parse_args()
    texts = requests(args.tokens, args.length)
    rng = np.random.default_rng(1)
    measured = {"repeat": [texts[i] for i in rng.choice(len(texts), args.requests, replace=False)],
                "fresh": requests(args.requests * args.length, args.length, seed=2)[: args.requests]}
    result = {"bench": "suffix_memory", "env": environment(), "args": vars(args),
              "ours": ours(texts, measured, args.prompt, args.gamma)}
    result["ours"]["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.arctic:
        result["arctic"] = arctic(texts, measured, args.prompt, args.gamma, args.arctic)
        result["arctic"]["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for name in ("ours", "arctic"):
        for workload in measured if name in result else ():
            r = result[name][workload]
            print(f"{name:7s} {workload:7s} {r['ms_per_committed_token']:.4f} ms CPU per committed token "
                  f"(runs {min(r['runs_ms']):.4f}-{max(r['runs_ms']):.4f}), {r['tokens_per_round']:.2f} "
                  f"tokens a round; fill {result[name]['fill_s']:.1f} s, peak RSS {result[name]['peak_rss_mb']:.0f} MB")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "env"}))


if __name__ == "__main__":
    main()
