"""DFlash, DFlash 2, EAGLE-3 and DSpark drafts (DSpark in its three packagings) through the
CLI: `generate -m TARGET -d DRAFT` picks the family's drafter from the draft's config.json,
drafts, and its greedy text equals drafting off (with a fixed γ and with --gamma auto, which
times one draft forward); `bench` sweeps γ with every setting md5-identical to drafting off."""

import pytest

from cli_support import invoke_json
from mlx_spec.testing.tiny_block_drafts import (save_tiny_dflash, save_tiny_dflash2, save_tiny_dspark, save_tiny_eagle3,
                                                save_tiny_specforge_dspark, save_tiny_speculators_dspark,
                                                tiny_dspark_config, tiny_speculators_dspark_config)
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4

pytest_plugins = ["cli_fixtures"]  # private_cost_cache


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("block-cli")
    save_tiny_gemma4(root / "target")
    save_tiny_dflash(root / "dflash")
    save_tiny_eagle3(root / "eagle3")
    save_tiny_dspark(root / "dspark", tiny_dspark_config(k_eq_v=True))
    save_tiny_dflash2(root / "dflash2")
    save_tiny_specforge_dspark(root / "dspark-specforge")
    save_tiny_speculators_dspark(root / "dspark-speculators", tiny_speculators_dspark_config(draft_vocab=64))
    return root


@pytest.mark.parametrize("family", ["dflash", "eagle3", "dspark", "dflash2", "dspark-specforge", "dspark-speculators"])
def test_cli_generate_and_bench(folders, family, private_cost_cache):
    models = ["-m", folders / "target", "-d", folders / family, "--raw", "-n", "24", "--temp", "0"]
    drafted = invoke_json(["generate", "Hello there", *models, "--gamma", "3"])
    plain = invoke_json(["generate", "Hello there", *models, "--drafter", "none"])
    assert drafted["drafter"] == family.split("-")[0] and drafted["text"] == plain["text"]
    assert drafted["stats"]["drafted"] > 0
    auto = invoke_json(["generate", "Hello there", *models, "--gamma", "auto"])
    assert auto["text"] == plain["text"] and auto["gamma"] == "auto"
    out = invoke_json(["bench", "-m", folders / "target", "-d", folders / family, "--prompt", "Hello there",
                       "--runs", "1", "--max-tokens", "12", "--gamma", "2", "--auto"])
    assert out["ok"] and out["identity_checked"] and out["drafter"] == family.split("-")[0]
    assert len({s["md5"] for s in out["settings"]}) == 1 and out["costs"]["draft_step"] > 0


def test_models_info_shows_the_drafts_family_block_and_taps(folders):
    facts = {family: invoke_json(["models", "info", str(folders / family), "--json"])["draft"]
             for family in ("dflash", "eagle3", "dspark")}
    assert facts["dflash"] == {"family": "dflash", "block_size": 8, "tap_layers": [1, 3, 5]}
    assert facts["eagle3"] == {"family": "eagle3", "tap_layers": [1, 3, 4], "draft_vocab": 64, "speculative_tokens": 3}
    assert facts["dspark"] == {"family": "dspark", "packaging": "deepspec", "backbone": "gemma4", "block_size": 8,
                               "tap_layers": [1, 3, 5], "k_eq_v": True, "markov_rank": 8, "draft_vocab": None,
                               "confidence_head": True}
