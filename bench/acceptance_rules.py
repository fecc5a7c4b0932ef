"""Acceptance at temperature 1: the paper's rule versus token matching.

mlx-spec accepts draft token x with probability min(1, p(x)/q(x)), so a position is
accepted with probability α = Σ_x min(p(x), q(x)). mlx-lm's speculative loop accepts x only
when an independent sample from p equals it: β = Σ_x p(x)·q(x). Both keep the target's
distribution; they differ in how many tokens a round commits.

Along a fixed text (teacher forcing) we compute p and q at every position from one forward
of each model, then α_t, β_t and the expected tokens per round for γ = 1..5 when a round
starts at position t: E_t(γ) = 1 + Σ_{j≤γ} Π_{i<j} a_{t+i}, averaged over t.

    python bench/acceptance_rules.py --draft q8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402
from pairs import draft_for, gemma270m, gemma_prompt_ids  # noqa: E402

from mlx_spec.core.sampling import LogitProcessor, SamplingParams  # noqa: E402


def expected_tokens_along(rates: list[float], gamma: int) -> float:
    """Mean over start positions t of 1 + Σ_{j=1..γ} Π_{i=0..j-1} rates[t+i]."""
    starts = len(rates) - gamma
    total = 0.0
    for t in range(starts):
        chain, e = 1.0, 1.0
        for i in range(gamma):
            chain *= rates[t + i]
            e += chain
        total += e
    return total / starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="q8", help="q8 | q4 | half (see pairs.draft_for)")
    parser.add_argument("--prompt", default="long", help="committed prompt: short | long | window")
    parser.add_argument("--temp", type=float, default=1.0)
    args = parser.parse_args()

    target = gemma270m("float32")
    draft = draft_for(args.draft, target)
    ids = gemma_prompt_ids(target.tokenizer, args.prompt)
    processor = LogitProcessor(SamplingParams(temperature=args.temp))
    tokens = mx.array(ids)[None]
    width = target.model(tokens[:, :1]).shape[-1]
    p = processor.distribution(target.model(tokens)[0, :-1])  # [L-1, V]
    q = processor.distribution(draft(tokens)[0, :-1, :width])
    alpha = mx.sum(mx.minimum(p, q), axis=-1)  # Σ min(p, q) per position
    beta = mx.sum(p * q, axis=-1)  # Σ p·q per position
    mx.eval(alpha, beta)
    alpha, beta = alpha.tolist(), beta.tolist()
    rows = []
    for gamma in range(1, 6):
        ours, theirs = expected_tokens_along(alpha, gamma), expected_tokens_along(beta, gamma)
        rows.append({"gamma": gamma, "expected_tokens_min_rule": ours, "expected_tokens_match_rule": theirs, "ratio": ours / theirs})
        print(f"γ={gamma}: E[tokens/round] Leviathan {ours:.3f}  token matching {theirs:.3f}  ratio {ours / theirs:.3f}x")
    mean_alpha, mean_beta = sum(alpha) / len(alpha), sum(beta) / len(beta)
    print(f"mean α = Σmin(p,q) = {mean_alpha:.3f}; mean β = Σp·q = {mean_beta:.3f} over {len(alpha)} positions")
    path = write_results(
        f"acceptance_rules_{args.draft}",
        {
            "target": "Gemma 3 270M (embedded GGUF) float32",
            "draft": args.draft,
            "prompt": args.prompt,
            "positions": len(alpha),
            "temperature": args.temp,
            "mean_alpha_min_rule": mean_alpha,
            "mean_beta_match_rule": mean_beta,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
