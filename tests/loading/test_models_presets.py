"""Presets file: the required entries exist and are well formed."""

import pytest

from mlx_spec.apps.runner import resolve_choice
from mlx_spec.errors import MlxSpecError
from mlx_spec.loading import Preset, get_preset, list_presets
from mlx_spec.loading.hub import looks_like_repo_id


def test_default_preset_is_the_offline_embedded_model():
    default = get_preset("default")
    assert list_presets()[0] == default
    assert default.target == "default" and default.draft is None
    assert default.drafter == "suffix" and default.gamma == "auto"


def test_every_model_preset_names_hub_models():
    presets = list_presets()
    assert len({p.name for p in presets}) == len(presets)
    for preset in presets:
        assert isinstance(preset, Preset) and preset.description
        if preset.drafter in ("model", "mtp", "dflash", "dflash2", "eagle3", "dspark"):
            assert looks_like_repo_id(preset.target) and looks_like_repo_id(preset.draft)
            assert preset.gamma == "auto" or preset.gamma >= 1
        assert 0 <= preset.top_p <= 1 and preset.top_k >= 0 and preset.temperature >= 0


def test_gemma3_pairs_and_a_gemma4_entry():
    presets = list_presets()
    gemma3 = [p for p in presets if p.family == "gemma3" and p.drafter == "model"]
    assert any("12b" in p.target and "270m" in p.draft for p in gemma3)
    assert any("27b" in p.target for p in gemma3)
    assert [p for p in presets if p.family == "gemma4" and "gemma-4" in p.target]


def test_gemma4_presets_draft_with_their_mtp_assistants():
    for name, size in (("gemma4-12b", "12B"), ("gemma4-e4b", "E4B")):
        preset = get_preset(name)
        assert preset.drafter == "mtp" and preset.family == "gemma4"
        assert f"gemma-4-{size}-it-assistant" in preset.draft
        assert f"gemma-4-{size.lower()}-it" in preset.target.lower()


def test_block_draft_presets_for_each_published_gemma4_pair():
    """12B, 31B and 26B-A4B each with the block drafts their publishers name."""
    expected = {"gemma4-12b-dflash": "z-lab/gemma4-12B-it-DFlash",
                "gemma4-12b-dspark": "deepseek-ai/dspark_gemma4_12b_block7",
                "gemma4-31b-dflash": "z-lab/gemma-4-31B-it-DFlash",
                "gemma4-31b-eagle3": "RedHatAI/gemma-4-31B-it-speculator.eagle3",
                "gemma4-31b-dspark": "RedHatAI/gemma-4-31B-it-speculator.dspark",
                "gemma4-26b-dflash": "z-lab/gemma-4-26B-A4B-it-DFlash",
                "gemma4-26b-dspark": "makora-ai/gemma4-26b-a4b-dspark"}
    for name, draft in expected.items():
        preset = get_preset(name)
        assert preset.draft == draft and preset.drafter == name.rsplit("-", 1)[1] and preset.family == "gemma4"
        size = {"12b": "12b", "31b": "31b", "26b": "26b-a4b"}[name.split("-")[1]]
        assert f"gemma-4-{size}-it" in preset.target.lower() and preset.gamma == "auto"


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(MlxSpecError) as error:
        get_preset("gemma9-huge")
    message = str(error.value)
    assert message.startswith("unknown preset 'gemma9-huge' (known: default, ")
    assert "\n" not in message


def test_base_model_preset_defaults_to_raw_prompts():
    from types import SimpleNamespace

    from mlx_spec.cli.common import use_chat
    from mlx_spec.loading import get_preset

    with_template = SimpleNamespace(chat_template="{{ x }}")
    default = get_preset("default")
    assert default.chat is False
    assert use_chat(with_template, None, default) is False
    assert use_chat(with_template, True, default) is True  # --chat wins
    assert use_chat(with_template, None, get_preset("gemma3-1b")) is True
    assert use_chat(SimpleNamespace(chat_template=None), None, None) is False


# -- presets and flags resolve to a choice before anything loads (runner.resolve_choice) --


def test_no_flags_mean_the_default_preset():
    choice = resolve_choice()
    assert (choice.target, choice.draft, choice.drafter, choice.gamma) == ("default", None, "suffix", "auto")
    assert choice.models == {"target": "default", "draft": None, "preset": "default"}


def test_a_preset_supplies_its_pair_and_flags_override_it():
    choice = resolve_choice(preset="gemma3-12b")
    preset = get_preset("gemma3-12b")
    assert (choice.target, choice.draft, choice.drafter) == (preset.target, preset.draft, "model")
    assert resolve_choice(preset="gemma3-12b", gamma="3").gamma == 3
    assert resolve_choice(preset="gemma3-12b", drafter="ngram").draft is None  # not loaded
    # --model alone leaves the presets out; --draft-model alone means drafting with it, as
    # "model" or "mtp" by the checkpoint's type once it is loaded (build_engine decides)
    assert resolve_choice(model="some/target").draft is None
    explicit = resolve_choice(model="some/target", draft_model="some/draft")
    assert (explicit.draft, explicit.drafter, explicit.models["preset"]) == ("some/draft", None, None)
    mtp = resolve_choice(preset="gemma4-12b")
    assert mtp.drafter == "mtp" and mtp.draft == get_preset("gemma4-12b").draft
    assert resolve_choice(model="some/target", drafter="none", gamma="5").gamma == 0


@pytest.mark.parametrize("flags,fragment", [
    ({"gamma": "17"}, "--gamma must be between 0 and 16"),
    ({"gamma": "x"}, "--gamma must be a whole number or 'auto'"),
    ({"drafter": "beam"}, "unknown drafter 'beam'"),
    ({"model": "some/target", "drafter": "model"}, "--drafter model needs a draft model"),
    ({"model": "some/target", "drafter": "mtp"}, "--drafter mtp needs a draft model"),
    ({"preset": "nope"}, "nope"),
])
def test_bad_choices_are_one_line_errors_before_loading(flags, fragment):
    with pytest.raises(MlxSpecError, match=fragment):
        resolve_choice(**flags)
