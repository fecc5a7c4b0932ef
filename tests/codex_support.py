"""Codex CLI against `serve`, for the Responses API tests (issue 42, item 1).

`AgentModel` is a `ScriptedModel` that acts as an agent would: until the prompt holds a
tool's answer it calls `exec_command` (Codex's shell tool) with `echo hello`, then it
answers `FINAL`. `codex_exec` runs the real `codex exec` against a base URL in a private
CODEX_HOME whose config.toml names the server as a model provider with
`wire_api = "responses"` (the configuration docs/server.md gives). `recorded` reads the
request bodies Codex sent in such a run (tests/data/codex/, see its README.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from scripted_model import END_OF_TURN_ID, TURN_ID, ScriptedModel

RECORDED = Path(__file__).parent / "data" / "codex"
COMMAND = "echo hello"
CALL = '<|tool_call>call:exec_command{cmd:<|"|>' + COMMAND + '<|"|>}<tool_call|>'
FINAL = "All done: hello"
THOUGHT = "<|channel>thought\nThe user wants a command run.<channel|>"


class AgentModel(ScriptedModel):
    """Calls `exec_command` until a tool's answer stands in its prompt, then says FINAL;
    with `thinks` set, each answer opens with a thought in Gemma 4's channel (a reasoning item)."""

    def __init__(self, tokenizer):
        super().__init__()
        self._encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        self._answered = tokenizer.convert_tokens_to_ids("<|tool_response>")
        self.thinks = False

    def answer(self, history: list[int]) -> list[int]:
        thought = THOUGHT if self.thinks else ""
        self.script = self._encode(thought + (FINAL if self._answered in history else CALL))
        # Only the latest turn decides what comes next (`ScriptedModel.answer` starts over at
        # each <|turn>): read from there, not the whole 40k-token prompt at every forward.
        # Rows before it are prompt positions, whose logits nothing reads.
        start = len(history) - 1 - history[::-1].index(TURN_ID) if TURN_ID in history else 0
        return [END_OF_TURN_ID] * start + super().answer(history[start:])


def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def codex_binary() -> Optional[str]:
    """The `codex` command: $MLX_SPEC_CODEX, else `codex` on PATH; None when absent."""
    return os.environ.get("MLX_SPEC_CODEX") or shutil.which("codex")


def codex_exec(binary: str, base_url: str, model: str, prompt: str, home: Path, workdir: Path,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """`codex exec PROMPT` with the server as its only model provider."""
    home.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "mlx-spec"\n\n[model_providers.mlx-spec]\n'
        f'name = "mlx-spec"\nbase_url = "{base_url}"\nwire_api = "responses"\n')
    env = {**os.environ, "CODEX_HOME": str(home)}
    return subprocess.run([binary, "exec", "--skip-git-repo-check", prompt], cwd=workdir, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
