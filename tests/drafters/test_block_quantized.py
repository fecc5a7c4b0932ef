"""A block draft quantized as `mlx_lm.convert -q` writes it (weights packed, a
`quantization` entry in config.json) is loaded, calibrated and exact: its cost curve's
draft step is one block forward (the calibration read the fc's input width off its packed
weight and crashed before), and greedy output is mlx-lm's plain decoding."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from conftest import greedy_reference
from mlx_spec.apps.calibration import measure_costs
from mlx_spec.apps.runner import build_engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.loading import load_pair
from mlx_spec.testing.tiny_block_drafts import save_tiny_dflash, save_tiny_dspark, tiny_dflash_config, tiny_dspark_config
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4

PROMPT = [2] + [(7 * i) % 250 + 6 for i in range(30)]
GROUP, BITS = 32, 4


def quantized_copy(folder, target, out):
    """`folder`'s draft quantized into `out` as mlx-lm's converter does."""
    pair = load_pair(str(target), str(folder), dtype="float32", progress=False)
    model = pair.draft.model
    # mlx-lm's rule: a layer is quantized where its input width is a multiple of the group
    nn.quantize(model, GROUP, BITS, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % GROUP == 0)
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": GROUP, "bits": BITS}}))
    return out


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_a_quantized_block_draft_is_calibrated_and_exact(tmp_path, family):
    save_tiny_gemma4(tmp_path / "target")
    if family == "dflash":
        save_tiny_dflash(tmp_path / "draft", tiny_dflash_config())
    else:
        save_tiny_dspark(tmp_path / "draft", tiny_dspark_config(k_eq_v=True))
    folder = quantized_copy(tmp_path / "draft", tmp_path / "target", tmp_path / "quantized")
    pair = load_pair(str(tmp_path / "target"), str(folder), dtype="float32", progress=False)
    assert isinstance(pair.draft.model.fc, nn.QuantizedLinear)
    curve = measure_costs(pair.target.model, pair.draft.model, max_width=3, context=32)
    assert curve.draft_step > 0
    engine = build_engine(pair)
    assert engine.drafter.name == family
    tokens = []
    for r in engine.rounds(PROMPT, SamplingParams(), gamma=3, max_tokens=24):
        tokens += r.tokens
    assert tokens == greedy_reference(pair.target.model, PROMPT, 24)
