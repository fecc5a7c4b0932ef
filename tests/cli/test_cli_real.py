"""The CLI on the embedded Gemma 3 270M (slow: real weights on a CPU)."""

import json

import pytest
from cli_support import invoke, invoke_json

pytestmark = pytest.mark.slow


def test_generate_on_the_default_preset(gemma270m):
    """No model flags: the "default" preset (embedded 270M, suffix drafts, γ auto)."""
    spec = invoke_json(["generate", "The three most useful habits for a new programmer are",
                        "--raw", "-n", "16"])
    assert spec["models"] == {"target": "default", "draft": None, "preset": "default"}
    assert spec["drafter"] == "suffix" and spec["gamma"] == "auto"
    assert spec["text"].strip() and spec["generated_tokens"] == 16
    plain = invoke_json(["generate", "The three most useful habits for a new programmer are",
                         "--raw", "-n", "16", "--drafter", "none"])
    assert plain["text"] == spec["text"]


def test_bench_on_the_default_preset(gemma270m):
    result = invoke(["bench", "--prompt", "short", "-n", "12", "--runs", "1", "--gamma", "1,3", "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["ok"] and out["identity_checked"]
    assert [s["setting"] for s in out["settings"]] == ["off", "γ=1", "γ=3"]
    assert out["prompts"] == {"short": 12}


def test_chat_on_the_default_preset_answers_instead_of_echoing(gemma270m):
    """Issue 45: in Gemma's turn format the base 270M echoed the question and junk
    ("What is the capital of France? mendatang" ×3); the default preset chats in plain
    "Question: …\\nAnswer:" text, and the answer ends where the model would ask the next."""
    result = invoke(["chat", "-n", "24"], input="What is the capital of France?\nAnd of Italy?\n")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    answers = [line.removeprefix(">>>").strip() for line in result.stdout.splitlines()
               if line.startswith(">>>") and line.removeprefix(">>>").strip()]
    assert answers[:2] == ["Paris", "Rome"], result.stdout
    assert "mendatang" not in result.stdout and "Question:" not in result.stdout
    # --chat-template still wins: Gemma's own turns bring the echo back
    echoed = invoke(["chat", "-n", "12", "--chat-template", "gemma3"], input="What is the capital of France?\n")
    assert "What is the capital of France?" in echoed.stdout.split(">>>", 2)[1]
