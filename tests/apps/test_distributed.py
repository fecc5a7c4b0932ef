"""Tensor parallelism over 2 ring ranks on localhost (tests/dist_support.py starts them).

References: mlx-lm's own unsharded forward (logits) and its `generate_step` (greedy output),
run in a single process on the same weights.
"""

from __future__ import annotations

import json

import mlx.nn as nn
import pytest
from dist_support import run_rank_script, tiny_gemma4_tp

from mlx_spec.errors import MlxSpecError
from mlx_spec.loading.sharding import check_shardable
from mlx_spec.testing.tiny import tiny_gemma3

# float32: sharding changes only the order of additions (each rank sums its heads / hidden
# units, then the all-reduce adds the parts), so logits move by float32 round-off.
RTOL = 1e-5  # of the largest |logit|


@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    return run_rank_script("logits", tmp_path_factory.mktemp("logits"))


CASES = ["gemma3 fp32 4q/1kv", "gemma3 fp32 4q/2kv", "gemma3 4-bit gs32",
         "gemma4 fp32 kv-shared", "gemma4 fp32 moe"]


@pytest.mark.parametrize("case", CASES)
def test_sharded_logits_match_unsharded(logits, case):
    for rank, result in enumerate(logits):
        r = result[case]
        assert r["max_diff"] <= RTOL * r["max_logit"], (rank, r)
        assert r["argmax_equal"], (rank, r)


@pytest.mark.parametrize("case", CASES)
def test_sharded_logits_bitwise_equal_across_ranks(logits, case):
    # What lets greedy decisions agree without a broadcast: the all-reduce hands every
    # rank the same sum, bit for bit.
    assert all(result[case]["bitwise_across_ranks"] for result in logits)


# ---------------------------------------------------------------------------------------
# What divides, what is refused (no ranks needed: the check runs before any sharding)
# ---------------------------------------------------------------------------------------


def test_gemma3_270m_shape_divides_by_1_2_4():
    # The real 270M: 4 query heads, 1 kv head (replicated), MLP 2048, head_dim 256.
    model = tiny_gemma3(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=256, intermediate_size=2048, num_hidden_layers=2, vocab_size=8)
    for n in (1, 2, 4):
        check_shardable(model, n)
    with pytest.raises(MlxSpecError, match=r"layer 0 has 4 query heads; ranks that divide this model: 1, 2, 4$"):
        check_shardable(model, 3)
    with pytest.raises(MlxSpecError, match="4 query heads"):
        check_shardable(model, 8)


def test_kv_heads_split_or_replicated_never_in_between():
    model = tiny_gemma3(num_attention_heads=8, num_key_value_heads=4, vocab_size=8, head_dim=8)
    check_shardable(model, 2)  # split: 2 kv heads per rank
    check_shardable(model, 8)  # replicated: each kv head on 2 ranks
    model = tiny_gemma3(num_attention_heads=6, num_key_value_heads=3, vocab_size=8, head_dim=8,
                        intermediate_size=96)
    with pytest.raises(MlxSpecError, match="3 kv heads"):
        check_shardable(model, 2)  # 2 neither divides 3 nor is a multiple of it


def test_quantization_groups_must_stay_whole():
    model = tiny_gemma3(num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=8)
    nn.quantize(model, group_size=64, bits=4)  # o_proj input 128, MLP 128: 64-wide groups
    check_shardable(model, 2)
    with pytest.raises(MlxSpecError, match=r"quantization groups of 64 .*ranks that divide this model: 1, 2$"):
        check_shardable(model, 4)


def test_unsupported_architecture_is_refused():
    class Other(nn.Module):
        model_type = "llama"

    with pytest.raises(MlxSpecError, match="not llama"):
        check_shardable(Other(), 2)


def test_gemma4_checks_every_layer_type():
    model = tiny_gemma4_tp(moe=True)
    check_shardable(model, 2)
    check_shardable(model, 4)  # q 4/4, sliding kv 2 replicated, global kv 1 replicated
    with pytest.raises(MlxSpecError, match="query heads"):
        check_shardable(model, 3)


# ---------------------------------------------------------------------------------------
# Speculative decoding over a sharded target
# ---------------------------------------------------------------------------------------

PROMPT = [2] + [10, 11, 12, 13, 14, 15, 16, 17] * 3  # 25 tokens, repetitive: n-gram drafts
MAX_TOKENS = 24  # prompt + output = 49 positions, three times the 16-token window


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from mlx_spec.testing.tiny import perturbed_copy, save_tiny_model
    from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4

    root = tmp_path_factory.mktemp("dist-models")
    target3, target4 = tiny_gemma3(seed=0), tiny_gemma4_tp(seed=3)
    return {
        "gemma3": save_tiny_model(root / "g3", target3),
        "gemma3-draft": save_tiny_model(root / "g3d", perturbed_copy(target3, noise=0.02, seed=1)),
        "gemma4": save_tiny_gemma4(root / "g4", target4),
        "gemma4-draft": save_tiny_gemma4(root / "g4d", perturbed_copy(target4, noise=0.02, seed=1)),
    }


def _reference(folder, max_tokens=MAX_TOKENS):
    from conftest import greedy_reference
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    return greedy_reference(model, PROMPT, max_tokens)


@pytest.mark.parametrize("target,draft_on", [("gemma3", "root"), ("gemma3", "all"), ("gemma4", "root")])
def test_speculative_over_two_ranks_is_exact(folders, tmp_path, target, draft_on):
    ranks = run_rank_script("decode", tmp_path, str(folders[target]), str(folders[f"{target}-draft"]),
                            draft_on, json.dumps(PROMPT), str(MAX_TOKENS))
    reference = _reference(folders[target])
    for rank, result in enumerate(ranks):
        assert result["sharded_load_matches"], rank  # mlx-lm's sharded_load, our shard()
        for case, tokens in result.items():
            if case.startswith("greedy"):
                assert tokens == reference, (rank, case)
    # Sampling: same seed, same decisions on every rank (rank 0's, where only it drafts).
    assert ranks[0] == ranks[1]
    sampled = [t for case, t in ranks[0].items() if case.startswith("sampled")]
    assert len(sampled) == 2
    assert all(len(t) == MAX_TOKENS for t in sampled) and sampled[0] != reference


@pytest.mark.slow
def test_real_gemma3_270m_over_two_ranks(gemma270m, tmp_path):
    """4 query heads split 2 + 2, the single kv head replicated; greedy n-gram speculation
    over the sharded model equals mlx-lm's greedy decoding of the whole model."""
    from conftest import greedy_reference

    tokenizer = gemma270m.tokenizer
    prompt = tokenizer.encode("Repeat after me: the quick brown fox jumps over the lazy dog. "
                              "Repeat after me: the quick brown fox")
    reference = greedy_reference(gemma270m.model, prompt, 12)
    ranks = run_rank_script("greedy", tmp_path, "default", json.dumps(prompt), "12", "[3]", timeout=150)
    for result in ranks:
        assert result["γ=3"] == reference


def test_mtp_drafter_is_refused_across_ranks():
    from types import SimpleNamespace

    from mlx_spec.apps.distributed import World
    from mlx_spec.apps.runner import build_engine

    two_ranks = World(SimpleNamespace(rank=lambda: 0, size=lambda: 2))
    pair = SimpleNamespace(draft=None, vocab_size_draft=None)
    with pytest.raises(MlxSpecError, match="MTP drafter reads the target's K/V cache"):
        build_engine(pair, "mtp", world=two_ranks)
