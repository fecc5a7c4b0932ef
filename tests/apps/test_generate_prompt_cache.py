"""`generate --prompt-cache FILE` and mlx-lm's prompt cache files (issue 29, item 3), both
ways: a file `mlx_lm cache_prompt` made is continued here as `mlx_lm generate
--prompt-cache-file` continues it, and a file made here is continued by mlx-lm as by us. The
references are mlx-lm's own commands (their `main`, given the arguments users give). On a
tiny Gemma 3 without sliding windows (every layer a KVCache), and on the tiny pair with its
16-token windows (RotatingKVCache layers in mlx-lm's files)."""

import importlib
import io
import sys
from contextlib import redirect_stdout
from unittest.mock import patch

import mlx.core as mx
import pytest
from cli_support import assert_one_line_error, invoke, invoke_json

from mlx_spec.testing.tiny import save_tiny_model

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

DOC = ("The lighthouse keeper wrote in his log every night: the wind, the ships that passed, "
       "the colour of the sea at dusk and the names of the birds")
QUERY = "What did he write?"
N = 10


@pytest.fixture(scope="module")
def global_dir(tmp_path_factory):
    """A tiny Gemma 3 whose every layer is global (no sliding window)."""
    return str(save_tiny_model(tmp_path_factory.mktemp("global") / "m", sliding_window_pattern=1))


@pytest.fixture(scope="module")
def theirs(global_dir, tiny_dirs, tmp_path_factory):
    """Files `mlx_lm cache_prompt` made of DOC: {"global": …, "windowed": …} (read-only)."""
    folder = tmp_path_factory.mktemp("mlx-lm-files")
    files = {"global": folder / "global.safetensors", "windowed": folder / "windowed.safetensors"}
    mlx_lm_cache(global_dir, files["global"])
    mlx_lm_cache(tiny_dirs[0], files["windowed"])
    return files


def mlx_lm(command, *args) -> str:
    """The stdout of mlx-lm's command (`mlx_lm.COMMAND ARGS`), run by its own `main` here
    (a process of its own would spend seconds importing)."""
    module = importlib.import_module(f"mlx_lm.{command}")
    out = io.StringIO()
    with patch.object(sys, "argv", [command, *map(str, args)]), redirect_stdout(out):
        module.main()
    return out.getvalue()


def mlx_lm_cache(model, path, prompt=DOC):
    mlx_lm("cache_prompt", "--model", model, "--prompt", prompt, "--prompt-cache-file", path)


def mlx_lm_answer(model, path) -> str:
    return mlx_lm("generate", "--model", model, "--prompt-cache-file", path, "--prompt", QUERY,
                  "--max-tokens", N, "--temp", "0", "--verbose", "False").rstrip("\n")


def ours(model, path, prompt=QUERY, *flags):
    return invoke_json(["generate", prompt, "--model", model, "--prompt-cache", path, "-n", N,
                        "--temp", "0", "--chat", *flags])


def test_a_file_made_by_mlx_lm_is_continued_as_mlx_lm_continues_it(global_dir, theirs):
    path = theirs["global"]
    out = ours(global_dir, path, QUERY, "--drafter", "ngram")
    assert out["text"] == mlx_lm_answer(global_dir, path)
    # only the query's own tokens were prefilled: the document came from the file
    assert 0 < out["stats"]["prefill_tokens"] < len(QUERY) + 16


def test_a_file_made_here_is_continued_by_mlx_lm_as_here(global_dir, tiny_dirs, theirs, tmp_path):
    """Our file holds what mlx-lm's does for the same prompt (the same K/V, to float rounding), and
    mlx-lm continues it as we do, with a draft model drafting."""
    from mlx_lm.models.cache import load_prompt_cache

    mine = tmp_path / "mine.safetensors"
    first = ours(global_dir, mine, DOC, "--draft-model", tiny_dirs[1], "--gamma", "2")  # caches DOC, then answers it
    assert first["finish_reason"] and mine.exists()
    for a, b in zip(load_prompt_cache(str(theirs["global"])), load_prompt_cache(str(mine))):
        assert type(a) is type(b) and a.offset == b.offset
        assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-4)
    again = ours(global_dir, mine, QUERY, "--draft-model", tiny_dirs[1], "--gamma", "2")
    assert again["text"] == mlx_lm_answer(global_dir, mine)
    assert again["stats"]["drafted"] > 0  # our ids are in the file: the draft model drafts


def test_sliding_window_layers_convert_both_ways(tiny_dirs, theirs, tmp_path):
    """mlx-lm's RotatingKVCache layers (the 16-token windows, long wrapped by DOC) become our
    WindowKVCache: the answer is mlx-lm's; and ours go back as RotatingKVCache."""
    target, draft = tiny_dirs
    mine = tmp_path / "mine.safetensors"
    out = ours(target, theirs["windowed"], QUERY, "--draft-model", draft)  # no ids in the file: drafting off
    assert out["text"] == mlx_lm_answer(target, theirs["windowed"])
    from mlx_lm.models.cache import load_prompt_cache

    ours(target, mine, DOC)
    assert [type(c).__name__ for c in load_prompt_cache(str(mine))] == [
        type(c).__name__ for c in load_prompt_cache(str(theirs["windowed"]))]  # RotatingKVCache, KVCache, …
    assert ours(target, mine, QUERY)["text"] == mlx_lm_answer(target, mine)


def test_files_that_do_not_fit_are_refused_in_one_line(global_dir, tiny_dirs, theirs, tmp_path):
    from mlx_lm.models.cache import RotatingKVCache, load_prompt_cache, save_prompt_cache

    target = tiny_dirs[0]
    path = theirs["global"]
    args = ["generate", QUERY, "--chat", "-n", "4", "--prompt-cache"]
    assert_one_line_error(invoke([*args, path, "--model", target]), "made for model")
    windowed = tmp_path / "windowed.safetensors"
    layers = load_prompt_cache(str(theirs["windowed"]))
    short = [RotatingKVCache.from_state((c.keys[..., :4, :], c.values[..., :4, :], c.offset, 0, c.max_size, 4))
             if isinstance(c, RotatingKVCache) else c for c in layers]
    save_prompt_cache(str(windowed), short, {"model": target, "tokenizer_config": "{}"})
    assert_one_line_error(invoke([*args, windowed, "--model", target]), "holds 4 positions, its window needs 15")
    # the same weights (seed) in both tiny models, but other windows; the draft's weights differ
    ours(global_dir, tmp_path / "mine.safetensors", DOC)
    assert_one_line_error(invoke([*args, tmp_path / "mine.safetensors", "--model", target]),
                          "other sliding windows")
    ours(target, tmp_path / "windowed-mine.safetensors", DOC)
    assert_one_line_error(invoke([*args, tmp_path / "windowed-mine.safetensors", "--model", tiny_dirs[1]]),
                          "another model")
    damaged = bytearray((tmp_path / "windowed-mine.safetensors").read_bytes())
    damaged[-5] ^= 0xFF  # inside the last array, past the header
    (tmp_path / "damaged.safetensors").write_bytes(bytes(damaged))
    assert_one_line_error(invoke([*args, tmp_path / "damaged.safetensors", "--model", target]),
                          "damaged (its arrays do not match their digest)")
    (tmp_path / "junk.safetensors").write_bytes(b"\x07" * 64)
    assert_one_line_error(invoke([*args, tmp_path / "junk.safetensors", "--model", target]), "not an mlx-lm prompt cache")


@pytest.mark.slow
def test_the_embedded_gemma_past_its_window(gemma270m, tmp_path):
    """The real Gemma 3 270M (512-token windows) on a prompt past its window: mlx-lm's file
    (RotatingKVCache layers, wrapped) is continued here as mlx-lm continues it. Its imported
    folder, as mlx-lm loads it (float16 weights, slow on a CPU: ours read by mlx-lm is the
    tiny windowed pair's test above)."""
    from mlx_spec.prompts import committed_prompts

    folder = str(gemma270m.path)
    # past the 512-token window (the rings wrap), not all of the prompt's 883 tokens: mlx-lm
    # prefills it at float16, the test's cost
    tokenizer = gemma270m.tokenizer
    text = tokenizer.decode(tokenizer.encode(committed_prompts()["window"], add_special_tokens=False)[:600])
    theirs = tmp_path / "theirs.safetensors"
    mlx_lm("cache_prompt", "--model", folder, "--prompt", text, "--prompt-cache-file", theirs)
    flags = ["--dtype", "float16", "--drafter", "ngram"]
    assert ours(folder, theirs, QUERY, *flags)["text"] == mlx_lm_answer(folder, theirs)
