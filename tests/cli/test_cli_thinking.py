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
from cli_support import ANSI, assert_usage_error, has_ansi, invoke, invoke_json
from thinking_support import ANSWER, ASK, THINKING_TEMPLATE, THOUGHT, thinking_engine, tokenizer_for

from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4

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
        monkeypatch.setattr(f"mlx_spec.cli.{command}.build_engine", lambda pair, drafter, **options: engine)
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
    parts = out["stats"]["thought_acceptance"], out["stats"]["answer_acceptance"]
    assert sum(p["drafted"] for p in parts) == out["stats"]["drafted"] > 0  # drafting went on
    assert (parts[0]["drafted"] > 0) == think


def test_think_needs_chat(model):
    assert_usage_error(invoke(["generate", "hi", *model, "--raw", "--think"]), "--think", "--chat")


def test_chat_shows_the_thought_then_the_answer(model, thinker):
    ids, thought, answer = reference(thinker, True)
    result = invoke(["chat", *model, "--think"], input=ASK[0]["content"] + "\n")
    assert result.exit_code == 0, result.stderr
    assert f"{thought}\n\n{answer}\n" in result.stdout
    assert "<|channel>" not in result.stdout and "<channel|>" not in result.stdout
    assert thinker[2].target.seen[: len(ids)] == ids


def test_chat_folds_the_thought_on_a_terminal(model, thinker):
    """On a terminal the thought is shown dimmed, then erased (cursor up over its rows,
    clear) and folded into one line when the answer starts; /thought shows it again."""
    import io

    from rich.console import Console

    from mlx_spec.apps.conversation import ChatSession
    from mlx_spec.apps.runner import Gamma
    from mlx_spec.cli.chat import ChatRepl
    from mlx_spec.core.sampling import SamplingParams

    _, tokenizer, engine = thinker
    session = ChatSession(engine, tokenizer, template_kwargs={"enable_thinking": True})
    repl = ChatRepl(session, None, engine, SamplingParams(), Gamma(2), 200, (), False)
    screen = io.StringIO()
    repl.console = Console(file=screen, force_terminal=True, width=50, height=40, highlight=False)
    repl.tty = True
    repl.answer(ASK[0]["content"])
    shown = screen.getvalue()
    rows = -(-len(THOUGHT) // 50)  # the thought's rows at 50 columns
    before, erase, after = shown.partition(f"\r\x1b[{rows - 1}A\x1b[J")
    assert erase and "\x1b[2m" in before and ANSI.sub("", before).endswith(THOUGHT)
    after = ANSI.sub("", after)
    assert after.startswith(f"[thought · {len(THOUGHT.split())} words · /thought shows it]\n{ANSWER}")
    end = len(screen.getvalue())
    repl.command("/thought")
    assert " ".join(ANSI.sub("", screen.getvalue()[end:]).split()) == THOUGHT


def test_generate_on_a_terminal_dims_the_thought_above_the_answer(thinker, monkeypatch):
    import io

    import rich.console

    from mlx_spec.apps.runner import Gamma
    from mlx_spec.apps.stream import encode_prompt, stream_generate
    from mlx_spec.cli.common import thought_splitter
    from mlx_spec.cli.generate import _live
    from mlx_spec.cli.render import ViewMaker
    from mlx_spec.core.stats import Stats

    _, tokenizer, engine = thinker
    screen, console = io.StringIO(), rich.console.Console
    monkeypatch.setattr(rich.console, "Console", lambda: console(file=screen, force_terminal=True, width=200))
    ids = encode_prompt(tokenizer, ASK[0]["content"], True, {"enable_thinking": True})
    stats = Stats()
    _live(lambda progress: stream_generate(engine, tokenizer, ids, gamma=2, max_tokens=200, stats=stats),
          ViewMaker(engine, 2, Gamma(2)), stats, False, thought_splitter(tokenizer, True, ids))
    shown = screen.getvalue()
    assert f"\x1b[2m{THOUGHT}" in shown.replace("\x1b[0m\x1b[2m", "")
    text = ANSI.sub("", shown)  # the live panel is redrawn between them
    assert f"{THOUGHT}\n\n" in text and ANSWER in text.split(THOUGHT)[1]
