"""One rank of a distributed test (started by tests/dist_support.py, one process per rank).

    python tests/dist_rank.py MODE OUT_DIR [ARGS...]

Each mode writes OUT_DIR/MODE-<rank>.json for the test to check:
  logits   sharded vs unsharded logits of tiny Gemma 3 / Gemma 4 models (prefill + decode
           with a KV cache), and whether the sharded logits are bitwise equal across ranks
  decode   TARGET DRAFT DRAFT_ON PROMPT_IDS MAX_TOKENS: token ids of greedy speculative
           decoding for γ in {1, 3} and both drafters, and of sampled decoding (seed 7)
  greedy   TARGET PROMPT_IDS MAX_TOKENS GAMMAS: greedy n-gram decoding per γ (TARGET may be
           "default", the embedded Gemma 3 270M), and the rank's peak memory after loading
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx_spec  # noqa: F401,E402  (first: it loads the optimised BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

from dist_support import tiny_gemma4_tp  # noqa: E402

from mlx_spec.apps import distributed  # noqa: E402
from mlx_spec.loading.sharding import shard_model  # noqa: E402
from mlx_spec.testing.tiny import tiny_gemma3  # noqa: E402


def _logits_case(model, world) -> dict:
    """Unsharded logits (mlx-lm's own forward), then the same model sharded."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([[2] + [(7 * i) % 250 + 10 for i in range(27)]])  # 28 tokens > window 16
    steps = [mx.array([[t]]) for t in (40, 41, 42)]

    def run():
        cache = make_prompt_cache(model)
        outs = [model(prompt, cache=cache)[0]]
        outs += [model(s, cache=cache)[0] for s in steps]
        out = mx.concatenate(outs).astype(mx.float32)
        mx.eval(out)
        return out

    reference = run()
    shard_model(model, world.group)
    sharded = run()
    gathered = mx.distributed.all_gather(sharded[None], group=world.group)
    return {
        "max_diff": mx.abs(sharded - reference).max().item(),
        "max_logit": mx.abs(reference).max().item(),
        "argmax_equal": bool(mx.all(sharded.argmax(-1) == reference.argmax(-1)).item()),
        "bitwise_across_ranks": bool(mx.all(gathered == gathered[0]).item()),
    }


def mode_logits(world, out: Path, *args) -> dict:
    cases = {}
    cases["gemma3 fp32 4q/1kv"] = tiny_gemma3(seed=0, num_attention_heads=4, num_key_value_heads=1)
    cases["gemma3 fp32 4q/2kv"] = tiny_gemma3(seed=0, num_attention_heads=4, num_key_value_heads=2)
    quantized = tiny_gemma3(seed=0, num_attention_heads=4, num_key_value_heads=2)
    nn.quantize(quantized, group_size=32, bits=4)
    cases["gemma3 4-bit gs32"] = quantized
    cases["gemma4 fp32 kv-shared"] = tiny_gemma4_tp(seed=0)
    cases["gemma4 fp32 moe"] = tiny_gemma4_tp(seed=0, moe=True)
    return {name: _logits_case(model, world) for name, model in cases.items()}


def mode_decode(world, out: Path, target: str, draft: str, draft_on: str, prompt: str,
                max_tokens: str) -> dict:
    from mlx_spec.apps.runner import build_engine
    from mlx_spec.core.sampling import SamplingParams

    pair = distributed.load_pair(world, target, draft, draft_on=draft_on, progress=False)
    prompt_ids = json.loads(prompt)
    results = {}

    def run(drafter, gamma, params):
        engine = build_engine(pair, drafter, world=world)
        tokens = []
        for rnd in engine.rounds(prompt_ids, params, gamma=gamma, max_tokens=int(max_tokens)):
            tokens += rnd.tokens
        return tokens

    # mlx-lm's own sharded_load works once our shard() is installed on its classes.
    from mlx_lm.utils import sharded_load

    from mlx_spec.loading.sharding import install

    install()
    theirs, _ = sharded_load(target)
    ids = mx.array([prompt_ids])
    results["sharded_load_matches"] = bool(mx.array_equal(theirs(ids), pair.target.model(ids)).item())

    for drafter in ("ngram", "model"):
        for gamma in (1, 3):
            results[f"greedy {drafter} γ={gamma}"] = run(drafter, gamma, SamplingParams())
        results[f"sampled {drafter} γ=3"] = run(drafter, 3, SamplingParams(temperature=1.0, seed=7))
    return results


def mode_greedy(world, out: Path, target: str, prompt: str, max_tokens: str, gammas: str) -> dict:
    """Greedy n-gram speculative decoding of `target` ("default": the embedded Gemma 3
    270M, float32) for each γ, and the peak memory of this rank."""
    from mlx_spec.apps.runner import build_engine
    from mlx_spec.core.sampling import SamplingParams

    mx.reset_peak_memory()
    pair = distributed.load_pair(world, None if target == "default" else target, dtype="float32",
                                 progress=False)
    engine = build_engine(pair, "ngram", world=world)
    results = {"peak_memory_after_load": mx.get_peak_memory()}
    for gamma in json.loads(gammas):
        results[f"γ={gamma}"] = [t for rnd in engine.rounds(json.loads(prompt), SamplingParams(), gamma=gamma,
                                                            max_tokens=int(max_tokens)) for t in rnd.tokens]
    return results


if __name__ == "__main__":
    mode, out_dir, *rest = sys.argv[1:]
    world = distributed.world()
    assert world.active, "launch with MLX_RANK / MLX_HOSTFILE set (tests/dist_support.py)"
    modes = {"logits": mode_logits, "decode": mode_decode, "greedy": mode_greedy}
    result = modes[mode](world, Path(out_dir), *rest)
    (Path(out_dir) / f"{mode}-{world.rank}.json").write_text(json.dumps(result))
