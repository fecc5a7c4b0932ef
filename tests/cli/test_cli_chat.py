"""`mlx-spec chat`: slash commands and turns through CliRunner (piped stdin), cache reuse
across turns, a conversation past the sliding window that stays exact, and a real
pseudo-terminal session (two turns, /gamma, /stats, /quit, Ctrl-C mid-answer)."""

import sys

import pytest
from cli_support import has_ansi, invoke, terminal_env

from mlx_spec.apps.conversation import ChatSession
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")


def test_turns_and_slash_commands_piped(models):
    script = "\n".join([
        "/help", "Hello there", "/gamma 2", "Tell me more", "/temp 0.7", "/stats", "/gamma x",
        "/bogus", "/reset", "/stats", "Again", "/quit", "never read",
    ]) + "\n"
    result = invoke(["chat", *models, "-n", "12", "--gamma", "3"], input=script)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    out = result.stdout
    assert "/gamma N|auto" in out  # help
    assert out.count("tok/s") >= 3  # one footer per turn, plus /stats
    assert "γ 3" in out and "γ set to 2" in out and "γ 2 ·" in out
    assert "temperature set to 0.7" in out
    assert "conversation: 2 turns" in out  # /stats after two turns
    assert "error: /gamma must be a whole number or 'auto'" in out and "unknown command /bogus" in out
    # /stats right after /reset has no answer to show (it showed the previous one)
    assert "conversation cleared\n>>> no answer yet" in out
    assert not has_ansi(out)


def test_eof_quits(models):
    result = invoke(["chat", *models, "-n", "4"], input="Hello\n")
    assert result.exit_code == 0 and "tok/s" in result.stdout


def test_drafter_none_rejects_gamma(models):
    result = invoke(["chat", *models, "-n", "4", "--drafter", "none"], input="/gamma 3\nHi\n")
    assert result.exit_code == 0
    assert "error: drafting is off" in result.stdout and "γ 0" in result.stdout


def test_second_turn_prefills_only_new_tokens(models):
    result = invoke(["chat", *models, "-n", "10", "--gamma", "2"],
                    input="Hello there\n/stats\nAnd now?\n/stats\n")
    assert result.exit_code == 0, result.stderr
    first, second = result.stdout.split("last answer")[1:3]
    prompt1, forwarded1 = _prefill_counts(first)
    prompt2, forwarded2 = _prefill_counts(second)
    assert prompt2 > prompt1
    assert forwarded2 < 2 * (prompt2 - prompt1) + 4  # both models: only the new tokens


def _prefill_counts(panel: str) -> tuple[int, int]:
    line = next(x for x in panel.splitlines() if "prompt tokens" in x)
    words = line.replace("(", " ").split()
    return int(words[words.index("prompt") - 1]), int(words[words.index("forwarded") - 1])


def test_long_conversation_past_the_window_stays_exact(tiny_dirs):
    """Several turns well past the 16-token window: speculative turns equal plain-decoding
    turns token for token (the same session logic the chat command drives)."""
    from mlx_spec.apps.runner import build_engine
    from mlx_spec.loading import load_pair

    target, draft = tiny_dirs
    pair = load_pair(target, draft)
    spec = build_engine(pair, "model")
    plain = Engine(pair.target.model, None, eos_ids=spec.eos_ids)
    answers = {}
    for name, engine, gamma in (("plain", plain, 0), ("spec", spec, 3)):
        session = ChatSession(engine, pair.tokenizer)
        answers[name] = []
        for turn in ("Hello there, how are you?", "Tell me about the sea.", "And the lighthouse?"):
            tokens = [t for r in session.ask(turn, SamplingParams(), gamma=gamma, max_tokens=24)
                      for t in r.round.tokens]
            answers[name].append(tokens)
        assert len(session.ids) > 100
    assert answers["spec"] == answers["plain"]


def _longest_answer_prompt(target_dir, candidates, limit=400):
    """A prompt whose greedy chat answer is long, so Ctrl-C lands mid-answer."""
    from mlx_lm import load

    from mlx_spec.apps.stream import generate

    model, tokenizer = load(target_dir)
    engine = Engine(model, None, eos_ids=tokenizer.eos_token_ids)
    lengths = {p: len(generate(engine, tokenizer, p, chat=True, gamma=0, max_tokens=limit).tokens)
               for p in candidates}
    return max(lengths, key=lengths.get), lengths


def test_chat_in_a_pseudo_terminal(tiny_dirs):
    pexpect = pytest.importorskip("pexpect")
    target, draft = tiny_dirs
    long_prompt, lengths = _longest_answer_prompt(target, ["abc", "Hello there", "xyz", "Tell me a story", "1 2 3"])
    assert lengths[long_prompt] >= 200, lengths
    child = pexpect.spawn(sys.executable, ["-m", "mlx_spec.cli", "chat", "--model", target,
                                           "--draft-model", draft, "-n", "400", "--gamma", "3"],
                          encoding="utf-8", dimensions=(40, 100), timeout=60, env=terminal_env())
    try:
        child.expect(">>> ")
        child.sendline("Hello there")
        child.expect(r"γ 3 · ")
        child.expect(">>> ")
        child.sendline("/gamma 2")
        child.expect("γ set to 2")
        child.expect(">>> ")
        child.sendline("Tell me more")
        child.expect(r"γ 2 · ")
        child.expect(">>> ")
        child.sendline("/stats")
        child.expect("position 2")
        child.expect("conversation: 2 turns")
        child.expect(">>> ")
        # Ctrl-C mid-answer (a fresh conversation, so the answer is known to be long): the
        # answer stops, the prompt comes back, the session goes on.
        child.sendline("/reset")
        child.expect(">>> ")
        child.sendline(long_prompt)
        child.expect(long_prompt + "\r\n")
        child.expect(".")
        child.sendintr()
        child.expect(r"\[stopped · (\d+) tok")
        assert int(child.match.group(1)) < lengths[long_prompt]
        child.expect(">>> ")
        child.sendline("/stats")
        child.expect("conversation: 1 turn, ")
        child.expect(">>> ")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
