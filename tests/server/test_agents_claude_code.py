"""The real Claude Code against `mlx-spec serve` (issue 42, item 2): `claude -p "say hi"` with
nothing set but its base URL and a key, on a tiny random Gemma 4 carrying Google's own
template (tests/data/templates/), its 25 real tools and all. The model answers garbage, so
what is checked is the protocol: Claude Code exits 0 and the server answered its requests
with 200s.

Skipped where `claude` is not on PATH (`npm install -g @anthropic-ai/claude-code`) or the
template is absent. Claude Code's first prompt is ~95,000 bytes, one token each for the
tiny byte-level tokenizer, so the model's context is made 131,072 tokens and every layer
sliding (a 16-token window), which keeps prefill linear on a CPU."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4
from server_support import Server, server_env

pytest_plugins = ["cli_fixtures"]  # fixtures: cost_cache, private_cost_cache
pytestmark = [pytest.mark.usefixtures("private_cost_cache"), pytest.mark.agents]

TEMPLATE = Path(__file__).parents[1] / "data" / "templates" / "gemma4.jinja"
CLAUDE = shutil.which("claude")


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (npm i -g @anthropic-ai/claude-code)")
def test_claude_code_completes_a_request_with_no_configuration(tmp_path, cost_cache):
    if not TEMPLATE.exists():
        pytest.skip(f"{TEMPLATE} is not here (tests/data/templates/README.md says where it comes from)")
    model = save_tiny_gemma4(tmp_path / "gemma4", chat_template=TEMPLATE.read_text(),
                             special_tokens=TEMPLATE_SPECIAL_TOKENS, max_position_embeddings=131072,
                             sliding_window_pattern=7)
    server = Server(["--model", model, "--drafter", "none", "--temp", "1", "--seed", "0", "--log-level", "info"],
                    server_env(cost_cache))
    try:
        home = tmp_path / "home"  # no user settings, no login: only the two variables below
        home.mkdir()
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": server.url,
               "ANTHROPIC_API_KEY": "dummy"}
        run = subprocess.run([CLAUDE, "-p", "say hi"], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=900)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:], server.log[-4000:])
    completed = re.search(r'^\w*requests_total\{outcome="completed"\} (\d+)', metrics, re.M)
    assert int(completed.group(1)) >= 1, metrics
    # every refusal is logged in one line with its route (`metrics.refusal_line`): there was none
    assert not re.search(r"^(HEAD|POST|GET) /\S* 4\d\d ", server.log, re.M), server.log[-4000:]
    assert not re.search(r'refusals_total\{', metrics), metrics
    assert "Traceback" not in server.log


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (npm i -g @anthropic-ai/claude-code)")
def test_mlx_spec_launch_claude(tmp_path, cost_cache):
    """The same through `mlx-spec launch claude --port PORT -- -p "say hi"`, nothing set by hand,
    on a server already running there (reused; a seeded one, so the garbage answer is the
    same as above: a random model's answer may call tools, and Claude Code would go on)."""
    if not TEMPLATE.exists():
        pytest.skip(f"{TEMPLATE} is not here (tests/data/templates/README.md says where it comes from)")
    model = save_tiny_gemma4(tmp_path / "gemma4", chat_template=TEMPLATE.read_text(),
                             special_tokens=TEMPLATE_SPECIAL_TOKENS, max_position_embeddings=131072,
                             sliding_window_pattern=7)
    server = Server(["--model", model, "--drafter", "none", "--temp", "1", "--seed", "0"], server_env(cost_cache))
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home),
           **{k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "VIRTUAL_ENV")}}
    try:
        run = subprocess.run([sys.executable, "-m", "mlx_spec.cli", "launch", "claude",
                              "--port", server.url.rsplit(":", 1)[1], "--", "-p", "say hi"],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert server.proc.poll() is None  # a server it did not start is left running
    finally:
        server.stop()
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "mlx-spec launch: claude on" in run.stderr and "Traceback" not in run.stderr
