"""The terminal surface a new user meets (issue 20), through the real CLI: usage errors in
our one-line style, `models list` at ordinary widths, bench's prompt names and α̂ cells,
wording, and feedback before the first token."""

import pytest
from cli_support import invoke

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")


# ---------------------------------------------------------------------------------------
# Usage errors: one line naming the flag, exit 2, the same `error: ...` style as ours
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,named,command", [
    (["generate", "x", "--temp", "-1"], "--temp", "mlx-spec generate"),
    (["generate", "x", "-n", "0"], "--max-tokens", "mlx-spec generate"),
    (["generate", "x", "--bogus"], "--bogus", "mlx-spec generate"),
    (["generate", "x", "--temp"], "--temp", "mlx-spec generate"),  # value missing
    (["generate", "x", "y"], "(y)", "mlx-spec generate"),
    (["bench", "--runs", "abc"], "--runs", "mlx-spec bench"),
    (["serve", "--port", "http"], "--port", "mlx-spec serve"),
    (["models", "info"], "'source'", "mlx-spec models info"),
    (["models", "nosuch"], "'nosuch'", "mlx-spec models"),
    (["nosuch"], "'nosuch'", "mlx-spec"),
    (["--bogus"], "--bogus", "mlx-spec"),
])
def test_usage_errors_are_one_line_naming_the_flag_and_exit_2(args, named, command):
    result = invoke(args)
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and named in lines[0], lines[0]
    assert lines[0].endswith(f"(see '{command} --help')"), lines[0]
    assert "Usage:" not in result.stderr and "╭" not in result.stderr and "Traceback" not in result.stderr


def test_our_errors_are_one_line_with_a_short_debug_hint():
    result = invoke(["generate", "x", "-m", "./no/such/model"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: target model: no such file or folder: ./no/such/model (--debug for the traceback)"]


def test_usage_error_in_a_real_process():
    """The console script as a user runs it (Typer's own handler would box the error)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("mlx-spec")
    if not script.exists():
        pytest.skip("the mlx-spec console script is not installed next to this interpreter")
    run = subprocess.run([str(script), "generate", "x", "--temp", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: invalid value for --temp: input should be greater than or equal to 0 "
        "(see 'mlx-spec generate --help')"]


# ---------------------------------------------------------------------------------------
# models list on an ordinary terminal
# ---------------------------------------------------------------------------------------

def _terminal_list(width: int) -> list[str]:
    """`models list` as a terminal of `width` columns shows it (Rich reads COLUMNS), as text."""
    from cli_support import ANSI
    from typer.testing import CliRunner

    from mlx_spec.cli import app

    result = CliRunner().invoke(app, ["models", "list"],
                                env={"COLUMNS": str(width), "TTY_COMPATIBLE": "1", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return ANSI.sub("", result.stdout).splitlines()


@pytest.mark.parametrize("width", [80, 120, 50, 220])
def test_models_list_never_cuts_a_name_and_keeps_the_key_columns(width):
    from mlx_spec.loading.presets import list_presets

    lines = _terminal_list(width)
    assert max(len(line) for line in lines) <= width
    words = [line.split() for line in lines]
    for preset in list_presets():
        if width >= 80:  # a table: the preset's row starts with its whole name, then drafter and γ
            row = next((w for w in words if w and w[0] == preset.name), None)
            assert row is not None, (preset.name, lines)
            assert preset.drafter in row and str(preset.gamma) in row, row
        else:  # one block per preset, titled with its whole name (a long id may fold)
            assert [preset.name] in words, (preset.name, lines)
            continue
        for model_id in (preset.target, preset.draft):
            if model_id:
                assert any(model_id in w for w in words), (model_id, lines)
    header = words[next(i for i, line in enumerate(lines) if "drafter" in line)] if width >= 80 else []
    if width >= 80:
        assert {"name", "drafter", "γ", "target"} <= set(header), header
        assert "draft" in header or "/" in header  # target and draft stacked in one column


# ---------------------------------------------------------------------------------------
# chat at a terminal: line editing, history, multi-line messages, Ctrl-D
# ---------------------------------------------------------------------------------------

LEFT, UP = "\x1b[D", "\x1b[A"
PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # what a terminal wraps a paste in


def _spawn_chat(tiny_dirs, cache):
    import sys

    from cli_support import terminal_env

    pexpect = pytest.importorskip("pexpect")
    target, draft = tiny_dirs
    env = {**terminal_env(), "MLX_SPEC_CACHE": str(cache)}
    return pexpect.spawn(sys.executable, ["-m", "mlx_spec.cli", "chat", "--model", target,
                                          "--draft-model", draft, "-n", "6", "--gamma", "2"],
                         encoding="utf-8", dimensions=(40, 100), timeout=60, env=env)


def test_chat_edits_lines_keeps_history_and_takes_multiline_messages(tiny_dirs, tmp_path):
    import pexpect

    child = _spawn_chat(tiny_dirs, tmp_path)
    try:
        child.expect(">>> ")
        child.send(f"/gamma 4{LEFT}1\r")  # Left moves before the 4: the line is /gamma 14
        child.expect("γ set to 14")
        child.expect(">>> ")
        child.send("/temp 0\r")
        child.expect("temperature set to 0")
        child.expect(">>> ")
        child.send(f"{UP}{UP}\r")  # two back in the history: /gamma 14 again
        child.expect("γ set to 14")
        child.expect(">>> ")
        child.send(f"{PASTE_START}Hello\rthere{PASTE_END}\r")  # a pasted block is one message
        child.expect(r"γ 14 · ")
        child.expect(">>> ")
        child.send('"""\r')  # a typed multi-line message
        child.expect(r"\.\.\. ")
        child.send("one\r")
        child.expect(r"\.\.\. ")
        child.send('two\r"""\r')
        child.expect(r"γ 14 · ")
        child.expect(">>> ")
        child.send("/stats\r")
        child.expect(r"conversation: (\d+) turn")
        assert child.match.group(1) == "2"  # the paste and the quoted block, one turn each
        child.expect(">>> ")
        child.sendcontrol("d")  # Ctrl-D leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    history = (tmp_path / "chat_history").read_text()
    assert "/gamma 14" in history and "/temp 0" in history

    child = _spawn_chat(tiny_dirs, tmp_path)  # the next session starts with that history
    try:
        child.expect(">>> ")
        child.send(f"{UP}\r")  # the last line of the last session: /stats
        child.expect("no answer yet")
        child.expect(">>> ")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


# ---------------------------------------------------------------------------------------
# bench: prompt names, and α̂ where nothing was drafted
# ---------------------------------------------------------------------------------------

def test_bench_refuses_a_misspelt_prompt_name(tiny_dirs):
    from cli_support import assert_usage_error

    result = invoke(["bench", "-m", tiny_dirs[0], "--prompt", "lnog"])
    assert_usage_error(result, "--prompt 'lnog' is not a committed prompt: did you mean 'long'?")


def test_bench_says_a_one_word_prompt_runs_as_text_and_shows_no_alpha_for_nothing_drafted(tiny_dirs):
    # Two tokens: the first comes from prefill, the one round after it finds no n-gram to
    # copy, so γ = 1 and auto draft nothing, like the plain row.
    result = invoke(["bench", "-m", tiny_dirs[0], "--drafter", "ngram", "--gamma", "1,auto",
                     "--prompt", "nosuch", "-n", "2", "--runs", "1"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert ("warning: --prompt 'nosuch' is not a committed prompt (long, quote, short, window) or @FILE: "
            "it runs as literal text, labelled 'custom'") in result.stderr
    table = result.stdout.split("acceptance and identity")[1]
    rows = {cells[0]: cells for cells in ([c for c in line.split() if c != "★"] for line in table.splitlines())
            if cells and cells[0] in ("off", "γ=1", "auto")}
    assert set(rows) == {"off", "γ=1", "auto"}, table
    for setting, cells in rows.items():
        mean_gamma = cells[-3]
        assert mean_gamma == "0.00", cells  # drafted nothing ...
        assert cells[1:3] == ["—", "—"], cells  # ... so no α̂ and no per-position acceptance


# ---------------------------------------------------------------------------------------
# Wording
# ---------------------------------------------------------------------------------------

def test_chat_stats_counts_one_turn_in_the_singular(models):
    result = invoke(["chat", *models, "-n", "4", "--gamma", "2"], input="Hello\n/stats\n/quit\n")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert "conversation: 1 turn, " in result.stdout and "1 turns" not in result.stdout


def test_models_info_for_a_preset_not_downloaded_exits_1_without_blaming_the_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    result = invoke(["models", "info", "gemma3-12b"])
    assert result.exit_code == 1
    assert "target: mlx-community/gemma-3-12b-it-4bit" in result.stdout  # what is known is shown
    assert "HF_HUB_OFFLINE" not in result.stdout + result.stderr  # the user set nothing
    assert "this command does not download" in result.stdout
    assert result.stderr.splitlines() == [
        "error: the target and draft of preset gemma3-12b are not downloaded; "
        "`mlx-spec generate --preset gemma3-12b` downloads them (--debug for the traceback)"]
    import os

    assert "HF_HUB_OFFLINE" not in os.environ  # forced offline only inside the command

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # now the user did set it: say so
    result = invoke(["models", "info", "gemma3-12b"])
    assert result.exit_code == 1 and "while HF_HUB_OFFLINE is set" in result.stdout


# ---------------------------------------------------------------------------------------
# Feedback during slow steps
# ---------------------------------------------------------------------------------------

def test_live_panel_shows_prefilling_not_zeros_before_the_first_token(tiny_dirs):
    import sys

    from cli_support import ANSI, terminal_env

    pexpect = pytest.importorskip("pexpect")
    target, draft = tiny_dirs
    child = pexpect.spawn(sys.executable, ["-m", "mlx_spec.cli", "generate", "Hello " * 40, "--model", target,
                                           "--draft-model", draft, "-n", "8", "--gamma", "2", "--raw"],
                          encoding="utf-8", dimensions=(40, 100), timeout=60, env=terminal_env())
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    screen = ANSI.sub("", child.before)
    assert "prefilling" in screen
    assert "(0 tokens in" not in screen and "peak memory       │ 0 B" not in screen, screen
    assert "(8 tokens in" in screen  # the final panel


@pytest.mark.slow
def test_first_run_import_shows_a_ticking_phase_not_a_frozen_bar(tmp_path):
    """The embedded GGUF's first import on a terminal: the long header read shows its phase
    and elapsed time, not an empty 0/? bar."""
    import sys

    from cli_support import ANSI, terminal_env

    pexpect = pytest.importorskip("pexpect")
    env = {**terminal_env(), "MLX_SPEC_CACHE": str(tmp_path)}
    child = pexpect.spawn(sys.executable, ["-m", "mlx_spec.cli", "models", "info", "default"],
                          encoding="utf-8", dimensions=(40, 120), timeout=300, env=env)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    screen = ANSI.sub("", child.before)
    header = [line for line in screen.replace("\r", "\n").splitlines() if "reading GGUF header" in line]
    assert header, screen
    assert not any("0/?" in line for line in header), header
    assert any(":00:0" in line for line in header), header  # elapsed time on the line
    assert any("dequantizing" in line and "/" in line for line in screen.replace("\r", "\n").splitlines())
