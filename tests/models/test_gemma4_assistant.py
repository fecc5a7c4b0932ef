"""The Gemma 4 MTP assistant against an independent implementation.

tests/data/gemma4_assistant_golden.json holds logits, next hidden states and 5-token drafts
computed by transformers' own Gemma4AssistantForCausalLM / Gemma4UnifiedAssistantForCausalLM
and its MTP candidate generator (versions recorded in the file; regenerate with
tests/data/make_gemma4_assistant_golden.py, which needs torch). Here the same tiny weights
(numpy's frozen RandomState streams) are written in the checkpoints' key layout, loaded by
our loader and run by our MLX implementation. Tolerance: 1e-4 absolute + 1e-4 relative, in
float32 on both sides. The "broken" cases show that a wrong attention scale, a `1 + w`
norm or a position one off all move the logits far outside it.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from data.make_gemma4_assistant_golden import CASES, case_inputs
from mlx.utils import tree_flatten

from mlx_spec.drafters.mtp import draft_greedy
from mlx_spec.loading import load_model
from mlx_spec.testing.tiny_gemma4 import (
    save_tiny_assistant,
    tiny_assistant_config,
    tiny_assistant_weights,
    tiny_gemma4_config,
)

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "gemma4_assistant_golden.json").read_text())
RTOL = ATOL = 1e-4
VARIANTS = list(GOLDEN["variants"])  # gemma4_assistant (centroid head), gemma4_unified_assistant (dense)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("assistants")
    out = {}
    for variant, entry in GOLDEN["variants"].items():
        config = tiny_assistant_config(tiny_gemma4_config(), centroids=entry["centroids"])
        assert config["model_type"] == variant
        weights = tiny_assistant_weights(config, GOLDEN["weight_seed"])
        out[variant] = (save_tiny_assistant(root / variant, config, weights), config)
    return out


@pytest.fixture(scope="module")
def assistants(folders):
    return {v: load_model(str(path), dtype="float32", progress=False) for v, (path, _) in folders.items()}


def inputs_for(config, case):
    name, sliding, full, position = next(c for c in CASES if c[0] == case["name"])
    x = case_inputs(config, tiny_gemma4_config(), sliding, full, seed=case["input_seed"])
    scale = config["backbone_hidden_size"] ** 0.5
    table = mx.array(x["target_embed"])
    kv = {"sliding_attention": tuple(map(mx.array, x["sliding"])),
          "full_attention": tuple(map(mx.array, x["full"]))}
    return {"embed": lambda ids: table[ids] * scale, "token": mx.array([[x["token"]]]),
            "h": mx.array(x["h"]), "kv": kv, "position": position}


def one_step(model, inputs, position=None):
    x = mx.concatenate([inputs["embed"](inputs["token"]), inputs["h"]], axis=-1)
    logits, next_h = model(x, inputs["kv"], inputs["position"] if position is None else position)
    return np.array(logits[0, 0]), np.array(next_h[0, 0])


def cases():
    return [(v, i) for v in VARIANTS for i in range(len(GOLDEN["variants"][v]["cases"]))]


@pytest.mark.parametrize("variant,index", cases())
def test_logits_and_next_hidden_match_transformers(folders, assistants, variant, index):
    case = GOLDEN["variants"][variant]["cases"][index]
    loaded = assistants[variant]
    assert loaded.tokenizer is None and loaded.config["model_type"] == variant
    logits, next_h = one_step(loaded.model, inputs_for(folders[variant][1], case))
    np.testing.assert_allclose(logits, case["logits"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(next_h, case["next_h"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("variant,index", cases())
def test_draft_matches_transformers_candidate_generator(folders, assistants, variant, index):
    """γ steps from one position: the token embedding and projected hidden state fed back
    exactly as transformers' SinglePositionMultiTokenCandidateGenerator feeds them."""
    case = GOLDEN["variants"][variant]["cases"][index]
    x = inputs_for(folders[variant][1], case)
    tokens = draft_greedy(assistants[variant].model, x["embed"], x["token"], x["h"], x["kv"],
                          x["position"], GOLDEN["draft_steps"])
    assert tokens.tolist() == case["draft"]


def _wrong_scale(model):
    for layer in model.layers:
        layer.self_attn.scale = layer.self_attn.head_dim ** -0.5


def _one_plus_w_norms(model):
    model.load_weights([(k, v - 1.0) for k, v in tree_flatten(model.parameters()) if k.endswith("norm.weight")],
                       strict=False)


@pytest.mark.parametrize("broken", ["scale", "norm", "position"])
def test_the_parity_check_catches_known_mistakes(folders, broken):
    """A peer's scale head_dim^-0.5, a norm stored as w − 1 read as 1 + w, and the other
    position convention each change the logits by far more than the tolerance."""
    variant = "gemma4_unified_assistant"
    case = GOLDEN["variants"][variant]["cases"][1]  # past the window
    model = load_model(str(folders[variant][0]), dtype="float32", progress=False).model
    inputs = inputs_for(folders[variant][1], case)
    position = inputs["position"] - 1 if broken == "position" else None
    {"scale": _wrong_scale, "norm": _one_plus_w_norms, "position": lambda m: None}[broken](model)
    logits, _ = one_step(model, inputs, position)
    assert np.max(np.abs(logits - np.array(case["logits"]))) > 100 * ATOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_assistant(folders, variant):
    """8-bit on load: the centroid scores stay in float (they pick which tokens get logits
    at all), the embedding is quantized and still serves both the tied head and the
    centroid head's row lookups; logits stay near the reference and greedy() agrees with
    the argmax of the full logits."""
    loaded = load_model(str(folders[variant][0]), dtype="float32", quantize=8, progress=False)
    model = loaded.model
    assert "scales" in dict(tree_flatten(model.model.embed_tokens.parameters()))
    if model.args.use_ordered_embeddings:
        assert "scales" not in dict(tree_flatten(model.masked_embedding.parameters()))
    for case in GOLDEN["variants"][variant]["cases"]:
        inputs = inputs_for(folders[variant][1], case)
        logits, _ = one_step(model, inputs)
        reference = np.array(case["logits"])
        assert np.corrcoef(logits, reference)[0, 1] > 0.995  # 8-bit rounding (seen: 0.9988+)
        x = mx.concatenate([inputs["embed"](inputs["token"]), inputs["h"]], axis=-1)
        h_d = model.hidden(x, inputs["kv"], inputs["position"])
        assert model.greedy(h_d).item() == int(np.argmax(np.array(model.logits(h_d))[0, 0]))


def test_checkpoint_layout(folders):
    """The E4B assistant's 50 tensors (12B's 48: no centroid head); token_ordering int64;
    `models info` describes it without a tokenizer."""
    from mlx_spec.loading import model_info

    path, _ = folders["gemma4_assistant"]
    info = model_info(str(path), progress=False)
    assert info["architecture"] == "gemma4_assistant" and info["layers"] == 4
    assert info["tokenizer_size"] is None and info["vocab_width"] == 272
    stored = mx.load(str(path / "model.safetensors"))
    assert len(stored) == 50 and stored["masked_embedding.token_ordering"].dtype == mx.int64
    assert not any(k.startswith("lm_head") for k in stored)
    assert len(mx.load(str(folders["gemma4_unified_assistant"][0] / "model.safetensors"))) == 48
