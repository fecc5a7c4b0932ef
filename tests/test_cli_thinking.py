"""`--think/--no-think` on `generate --chat` and `chat` (issue 30, item 2): the flag reaches
the chat template as enable_thinking (the prompt is transformers' rendering of it), and the
thought is split from the answer: piped `generate` writes the answer alone on stdout and
the thought on stderr, `--json` has both, `chat` shows the thought before the answer.

The checkpoint folder holds a tiny Gemma 4 with `thinking_support`'s tokenizer and thinking
template; the engine is `thinking_support`'s scripted model (with an n-gram drafter, so
drafting runs through the thought), put in place of the loaded one.
"""

import pytest

import thinking_support
from cli_support import assert_usage_error, has_ansi, invoke, invoke_json
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4
from thinking_support import ANSWER, ASK, THINKING_TEMPLATE, THOUGHT, thinking_engine, tokenizer_for

pytest_plugins = ["cli_fixtures"]
pytestmark = pytest.mark.usefixtures("private_cost_cache")
FLAGS = ["--drafter", "ngram", "--gamma", "2", "-n", "200"]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """(checkpoint folder, tokenizer, engine)."""
    path = tmp_path_factory.mktemp("thinker")
    save_tiny_gemma4(path, chat_template=THINKING_TEMPLATE)
    tokenizer = tokenizer_for(path, THINKING_TEMPLATE)  # over the checkpoint's own
    return path, tokenizer, thinking_engine(tokenizer, NgramDrafter())


@pytest.fixture
def model(thinker, monkeypatch):
    path, _, engine = thinker
    for command in ("generate", "chat"):
        monkeypatch.setattr(f"mlx_spec.cli.{command}.build_engine", lambda pair, drafter: engine)
    return ["--model", str(path), *FLAGS]


def reference(thinker, enable_thinking):
    _, tokenizer, engine = thinker
    return thinking_support.reference(tokenizer, engine.target, ASK, enable_thinking)


def test_generate_piped_answer_on_stdout_thought_on_stderr(model, thinker):
    _, thought, answer = reference(thinker, True)
    result = invoke(["generate", ASK[0]["content"], *model, "--chat", "--think"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == answer + "\n" and answer == ANSWER
    assert result.stderr.startswith(thought + "\n") and thought == THOUGHT
    assert not has_ansi(result.stdout + result.stderr)


@pytest.mark.parametrize("think", [True, False])
def test_generate_json_prompt_is_the_templates(model, thinker, think):
    ids, thought, answer = reference(thinker, think)
    out = invoke_json(["generate", ASK[0]["content"], *model, "--chat", "--think" if think else "--no-think"])
    assert out["prompt_tokens"] == len(ids)
    assert thinker[2].target.seen[: len(ids)] == ids
    assert (out["reasoning"], out["text"]) == (thought, answer)
    assert bool(thought) == think


def test_think_needs_chat(model):
    assert_usage_error(invoke(["generate", "hi", *model, "--raw", "--think"]), "--think", "--chat")


def test_chat_shows_the_thought_then_the_answer(model, thinker):
    ids, thought, answer = reference(thinker, True)
    result = invoke(["chat", *model, "--think"], input=ASK[0]["content"] + "\n")
    assert result.exit_code == 0, result.stderr
    assert f"{thought}\n\n{answer}\n" in result.stdout
    assert "<|channel>" not in result.stdout and "<channel|>" not in result.stdout
    assert thinker[2].target.seen[: len(ids)] == ids
