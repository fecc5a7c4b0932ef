"""Codex CLI against the Responses API (issue 42, item 1): the requests Codex CLI 0.171 sent
in a tool round trip (tests/data/codex/) replayed raw and through the SDK, and the real
`codex exec` end to end (marked slow; skipped when codex is not installed). The model is
`codex_support.AgentModel`: it calls Codex's `exec_command`, then answers once the command's
output is in its prompt; the template is our Gemma-4-shaped one and Google's own where
tests/data/templates/ has it."""

import json

import pytest

from codex_support import COMMAND, FINAL, AgentModel, codex_binary, codex_exec, recorded
from responses_support import CONTEXT, MODEL, Served, gemma4_templates, stream_events, template_tokenizer


@pytest.fixture(scope="module", params=list(gemma4_templates()))
def agent(request, tmp_path_factory):
    tokenizer = template_tokenizer(tmp_path_factory.mktemp("agent-" + request.param), request.param)
    served = Served(tokenizer, AgentModel(tokenizer), context=CONTEXT)
    yield served
    served.server.stop()


def test_codex_requests_replayed(agent):
    """Codex's two requests of `codex exec "say hello by running echo"` (its tools, developer
    messages, namespace and web_search tools, a function call and its output), replayed raw."""
    first = recorded("turn1.json")
    assert first["stream"] and {t["type"] for t in first["tools"]} == {"function", "namespace", "web_search"}
    events = stream_events(agent.post({**first, "model": MODEL}))
    first_prompt = events[-1]["response"]["usage"]["input_tokens"]
    [call] = events[-1]["response"]["output"]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "exec_command",
                                                                            {"cmd": COMMAND})
    second = recorded("turn2.json")
    assert [item["type"] for item in second["input"][-2:]] == ["function_call", "function_call_output"]
    events = stream_events(agent.post({**second, "model": MODEL}))
    assert events[-1]["type"] == "response.completed"
    # the whole conversation comes each turn: the first turn's prompt is read from the cache
    assert events[-1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] >= first_prompt - 1
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == FINAL
    assert "<|tool_response>response:exec_command" in agent.tokenizer.decode(agent.model.seen)
    # through the SDK too, whole
    body = {k: v for k, v in second.items() if k not in ("model", "stream")}
    assert agent.client.responses.create(model=MODEL, **body).output_text == FINAL


@pytest.mark.slow
@pytest.mark.parametrize("thinks", [False, True], ids=["answers", "thinks"])
def test_codex_exec_runs_a_command_and_answers(agent, tmp_path, thinks):
    """The real Codex CLI (`npm install -g @openai/codex`; or MLX_SPEC_CODEX=path) against
    `serve`: it runs the command the model calls for and prints the model's final answer,
    with the model's thoughts (reasoning items, which Codex sends back) or without."""
    binary = codex_binary()
    if binary is None:
        pytest.skip("codex is not installed (npm install -g @openai/codex)")
    agent.model.thinks = thinks
    try:
        done = codex_exec(binary, agent.base, MODEL, "say hello by running echo", tmp_path / "home",
                          tmp_path / "work")
    finally:
        agent.model.thinks = False
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == FINAL
    assert COMMAND in done.stderr and "succeeded" in done.stderr
