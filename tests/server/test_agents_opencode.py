"""The real opencode against `mlx-spec serve` (issue 42): `opencode run "say hi"` configured as
`mlx-spec launch opencode` configures it (an OpenAI-compatible provider in the file
OPENCODE_CONFIG names; nothing else set), on a tiny random Gemma 4 carrying Google's own
template (tests/data/templates/), its real tools and all (opencode always sends tools, so a
model whose template has no call format, Gemma 3's, refuses it). The model answers garbage,
so what is checked is the protocol: opencode exits 0, its requests (the title request and
the main one) were answered 200, nothing was refused.

Skipped where `opencode` is not on PATH (`npm install -g opencode-ai`; or set
MLX_SPEC_OPENCODE to it) or the template is absent. opencode fetches its provider package
(`@ai-sdk/openai-compatible`) from npm on first use, so it needs the npm registry once."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from server_support import Server, server_env

from mlx_spec.cli.launch import client_setup
from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4

pytest_plugins = ["cli_fixtures"]  # fixtures: cost_cache, private_cost_cache
pytestmark = [pytest.mark.usefixtures("private_cost_cache"), pytest.mark.agents]

TEMPLATE = Path(__file__).parents[1] / "data" / "templates" / "gemma4.jinja"
OPENCODE = os.environ.get("MLX_SPEC_OPENCODE") or shutil.which("opencode")


@pytest.mark.skipif(OPENCODE is None, reason="opencode is not installed (npm i -g opencode-ai)")
def test_opencode_run_completes_against_serve(tmp_path, cost_cache):
    if not TEMPLATE.exists():
        pytest.skip(f"{TEMPLATE} is not here (tests/data/templates/README.md says where it comes from)")
    model = save_tiny_gemma4(tmp_path / "model", chat_template=TEMPLATE.read_text(),
                             special_tokens=TEMPLATE_SPECIAL_TOKENS, max_position_embeddings=131072,
                             sliding_window_pattern=7)
    server = Server(["--model", model, "--served-model-name", "tiny", "--temp", "1", "--seed", "0",
                     "--log-level", "info"], server_env(cost_cache))
    try:
        home = tmp_path / "home"  # no user settings: only the config launch writes
        home.mkdir()
        env, args = client_setup("opencode", server.url, "dummy", "tiny", tmp_path)
        run = subprocess.run([OPENCODE, "run", *args, "say hi"], env={"PATH": os.environ["PATH"], "HOME": str(home), **env},
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:], server.log[-4000:])
    completed = re.search(r'^\w*requests_total\{outcome="completed"\} (\d+)', metrics, re.M)
    assert int(completed.group(1)) >= 2, metrics  # the title request and the main one
    assert not re.search(r'refusals_total\{', metrics) and not re.search(r'http_responses_total\{code="[45]', metrics)
    assert "Traceback" not in server.log
