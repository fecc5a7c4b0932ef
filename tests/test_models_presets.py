"""Presets file: the required entries exist and are well formed."""

import pytest

from mlx_spec.errors import MlxSpecError
from mlx_spec.models import Preset, get_preset, list_presets
from mlx_spec.models.hub import looks_like_repo_id


def test_default_preset_is_the_offline_embedded_model():
    default = get_preset("default")
    assert list_presets()[0] == default
    assert default.target == "default" and default.draft is None
    assert default.drafter == "ngram" and default.gamma == "auto"


def test_every_model_preset_names_hub_models():
    presets = list_presets()
    assert len({p.name for p in presets}) == len(presets)
    for preset in presets:
        assert isinstance(preset, Preset) and preset.description
        if preset.drafter == "model":
            assert looks_like_repo_id(preset.target) and looks_like_repo_id(preset.draft)
            assert preset.gamma == "auto" or preset.gamma >= 1
        assert 0 <= preset.top_p <= 1 and preset.top_k >= 0 and preset.temperature >= 0


def test_gemma3_pairs_and_a_gemma4_entry():
    presets = list_presets()
    gemma3 = [p for p in presets if p.family == "gemma3" and p.drafter == "model"]
    assert any("12b" in p.target and "270m" in p.draft for p in gemma3)
    assert any("27b" in p.target for p in gemma3)
    assert [p for p in presets if p.family == "gemma4" and "gemma-4" in p.target]


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(MlxSpecError) as error:
        get_preset("gemma9-huge")
    message = str(error.value)
    assert message.startswith("unknown preset 'gemma9-huge' (known: default, ")
    assert "\n" not in message


def test_base_model_preset_defaults_to_raw_prompts():
    from types import SimpleNamespace

    from mlx_spec.cli.common import use_chat
    from mlx_spec.models import get_preset

    with_template = SimpleNamespace(chat_template="{{ x }}")
    default = get_preset("default")
    assert default.chat is False
    assert use_chat(with_template, None, default) is False
    assert use_chat(with_template, True, default) is True  # --chat wins
    assert use_chat(with_template, None, get_preset("gemma3-1b")) is True
    assert use_chat(SimpleNamespace(chat_template=None), None, None) is False
