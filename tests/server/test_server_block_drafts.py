"""`mlx-spec serve --parallel 2` with a DFlash, a DFlash 2, an EAGLE-3 and a DSpark draft (the
last in its three packagings; `-d FOLDER`, the family told by its config.json): two greedy
completions asked at once each equal mlx-lm's own `load` + `generate` of its prompt, nothing
fails, and the server drafted."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from mlx_lm import generate, load
from server_support import Server, server_env

from mlx_spec.testing.tiny_block_drafts import (save_tiny_dflash, save_tiny_dflash2, save_tiny_dspark, save_tiny_eagle3,
                                                save_tiny_specforge_dspark, save_tiny_speculators_dspark,
                                                tiny_dspark_config, tiny_speculators_dspark_config)

PROMPTS = ["one two one two one two", "three four five three four"]
TOKENS = 12

pytest_plugins = ["cli_fixtures"]  # fixtures: gemma4_dirs


@pytest.fixture(scope="module")
def drafts(gemma4_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("block-drafts")
    save_tiny_dflash(root / "dflash")
    save_tiny_eagle3(root / "eagle3")
    save_tiny_dspark(root / "dspark", tiny_dspark_config(k_eq_v=True))
    save_tiny_dflash2(root / "dflash2")
    save_tiny_specforge_dspark(root / "dspark-specforge")
    save_tiny_speculators_dspark(root / "dspark-speculators", tiny_speculators_dspark_config(draft_vocab=64))
    return root


@pytest.fixture(scope="module")
def mlx_lm_answers(gemma4_dirs):
    model, tokenizer = load(str(gemma4_dirs / "target"))
    return [generate(model, tokenizer, tokenizer.encode(p), max_tokens=TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("family", ["dflash", "eagle3", "dspark", "dflash2", "dspark-specforge", "dspark-speculators"])
def test_serve_parallel_answers_with_a_block_draft(family, gemma4_dirs, drafts, mlx_lm_answers, tmp_path):
    server = Server(["--model", gemma4_dirs / "target", "-d", drafts / family, "--gamma", "3", "--parallel", "2"],
                    server_env(tmp_path / "costs"))
    try:
        client = server.client()
        model = client.models.list().data[0].id

        def ask(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0)

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(ask, PROMPTS))
        assert [a.choices[0].text for a in answers] == mlx_lm_answers
        health = server.health()
        assert health["failed"] == 0, health
    finally:
        server.stop()
    assert "Traceback" not in server.log, server.log
