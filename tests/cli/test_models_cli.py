"""`mlx-spec models list|info`: output for people and for scripts, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlx_spec.cli import app
from mlx_spec.testing.tiny import save_tiny_model

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    """`--debug` in another test sets MLX_SPEC_DEBUG process-wide; errors here must be one line."""
    monkeypatch.delenv("MLX_SPEC_DEBUG", raising=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cli") / "tiny")


def test_list_plain_when_piped():
    result = runner.invoke(app, ["models", "list"])
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split("\t")[:3] == ["name", "target", "draft"]
    assert lines[1].startswith("default\tdefault\t-\tsuffix\tauto\t")
    assert "\x1b[" not in result.stdout  # no colour codes in a pipe


def test_list_json():
    result = runner.invoke(app, ["models", "list", "--json"])
    presets = json.loads(result.stdout)
    assert presets[0]["name"] == "default" and {"gamma", "drafter", "top_k"} <= set(presets[0])


def test_info_json_for_a_folder(tiny_dir):
    result = runner.invoke(app, ["models", "info", str(tiny_dir), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["architecture"] == "gemma3_text" and info["kind"] == "local"
    assert info["layers"] == 4 and info["sliding_window"] == 16
    assert info["sliding_window_pattern"] == 2
    assert info["vocab_width"] == 272 and info["tokenizer_size"] == 262
    assert info["quantization"] is None and info["dtype"] == "float32"
    assert info["weight_bytes"] == 4 * info["parameters"]  # float32, tied embeddings
    assert info["eos_token_ids"] == [1, 5] and info["chat_template"] == "Gemma turn format (fallback)"


def test_info_table_for_a_folder(tiny_dir):
    result = runner.invoke(app, ["models", "info", str(tiny_dir)])
    assert result.exit_code == 0
    assert "vocab_width: 272 logits (tokenizer: 262)" in result.stdout
    assert "quantization: none" in result.stdout


def test_info_for_a_preset_does_not_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    result = runner.invoke(app, ["models", "info", "gemma3-12b", "--json"])
    assert result.exit_code == 1, result.output  # what is known is printed; the models are not there
    info = json.loads(result.stdout)
    assert info["preset"]["name"] == "gemma3-12b"
    assert info["target"]["status"].startswith("not available locally")


@pytest.mark.parametrize("args, fragment", [
    (["models", "info", "/nonexistent"], "no such file or folder: /nonexistent"),
    (["models", "info", "not-a-model"], "nor a Hugging Face repo id"),
    (["models", "import", "/nonexistent.gguf"], "no such file: /nonexistent.gguf"),
])
def test_errors_are_one_line_without_traceback(args, fragment):
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and fragment in result.stderr.splitlines()[0]
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)  # a clean exit, not an escaped error


def test_offline_unknown_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    result = runner.invoke(app, ["models", "info", "no-org/no-model"])
    assert result.exit_code == 1
    first = result.stderr.splitlines()[0]
    assert "'no-org/no-model' is not a local path" in first and "HF_HUB_OFFLINE" in first


def test_real_subprocess_exits_nonzero_without_traceback():
    """The installed console script, as a user runs it."""
    script = Path(sys.executable).with_name("mlx-spec")
    command = [str(script)] if script.exists() else [
        sys.executable, "-c", "from mlx_spec.cli import main; main()"]
    env = {k: v for k, v in os.environ.items() if k != "MLX_SPEC_DEBUG"}
    result = subprocess.run([*command, "models", "info", "/nonexistent"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert result.stderr == "error: no such file or folder: /nonexistent (--debug for the traceback)\n"
    assert "Traceback" not in result.stderr and result.stdout == ""
