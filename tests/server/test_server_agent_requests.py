"""Requests as the agents send them (issue 42, items 2-4 and 9), replayed from recordings of
the real clients (`tests/data/agents/`: Claude Code 2.1.197's first request of `claude -p`,
opencode 1.18's title and main requests, taken by a logging HTTP server) against the server
on Google's own Gemma 4 templates (tests/data/templates/, skipped where absent) and on the
Gemma 3 turn format, whose template refuses roles that do not alternate.

The model is `scripted_model.ScriptedModel`, so the answer is known (it answers after
Gemma 4's `<|turn>model` opener: on the Gemma 3 format, whose turns open otherwise, it says
nothing, and only the prompt is checked); what is checked is what each client needs: a 200
in the shape it reads, the prompt the template renders from what it sent, and max tokens
clamped to the context."""

import json
import re
from pathlib import Path

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from mlx_spec.core.engine import Engine
from mlx_spec.loading.chat_templates import GEMMA_CHAT_TEMPLATE
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.server.anthropic_requests import MessagesRequest, template_messages
from mlx_spec.server.template_fit import walked_schema, walked_tools
from scripted_model import (EOS_ID, END_OF_TURN_ID, GOOGLE_SPECIAL_TOKENS, SPECIAL_TOKENS, TOOL_TEMPLATE,
                            InProcessServer, ScriptedModel, save_tokenizer)

AGENTS = Path(__file__).parents[1] / "data" / "agents"
TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
GOOGLE = ("gemma4.jinja", "google-gemma-4-31B-it-interleaved.jinja")
MODEL = "scripted"
CONTEXT = 8192  # the server's; Claude Code's prompt is ~92,000 bytes, so tests that send it set more


def recorded(name: str) -> dict:
    return json.loads((AGENTS / name).read_text())


def google_template(name: str) -> str:
    path = TEMPLATES / name
    if not path.exists():
        pytest.skip(f"{path} is not here (tests/data/templates/README.md says where it comes from)")
    return path.read_text()


def claude_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}}
            for t in recorded("claude_code_request.json")["tools"]]


class Served:
    def __init__(self, tmp_path, template: str, context: int = CONTEXT, special_tokens=GOOGLE_SPECIAL_TOKENS,
                 **options):
        self.tokenizer = load_tokenizer(save_tokenizer(tmp_path, template, special_tokens),
                                        eos_token_ids=[EOS_ID, END_OF_TURN_ID])
        self.model = ScriptedModel()
        engine = Engine(self.model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=context)
        self.server = InProcessServer(create_app(engine, self.tokenizer, ServerOptions(
            model_name=MODEL, gamma="0", context_length=context, **options)))
        self.base = self.server.base.removesuffix("/v1")

    def say(self, text: str) -> None:
        self.model.script = list(self.tokenizer.encode(text, add_special_tokens=False))

    def seen_text(self, prompt_tokens: int) -> str:
        return self.tokenizer.decode(self.model.seen[:prompt_tokens])

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.base + path, json=body, timeout=120, headers={"x-api-key": "dummy"})


@pytest.fixture
def served(tmp_path):
    made = []

    def make(template: str, **kwargs) -> Served:
        made.append(Served(tmp_path / str(len(made)), template, **kwargs))
        return made[-1]

    yield make
    for one in made:
        one.server.stop()


def sse_events(text: str) -> list[tuple[str, dict]]:
    return [(m.group(1), json.loads(m.group(2))) for m in re.finditer(r"event: (\S+)\ndata: (.*)\n", text)]


# -- Claude Code --------------------------------------------------------------------------


@pytest.mark.parametrize("template", GOOGLE)
def test_claude_codes_first_request_is_answered_as_sent(template, served):
    """Its system message inside `messages`, adaptive thinking, context_management, its own
    model name and 64,000 max tokens: a 200 stream under the served name, the system
    message in the system turn, every tool declared, the answer ending at the context."""
    server = served(google_template(template), context=131072)
    server.say("hi")
    body = recorded("claude_code_request.json")
    response = server.post("/v1/messages?beta=true", body)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    start = events[0][1]["message"]
    assert events[0][0] == "message_start" and start["model"] == MODEL
    text = "".join(e["delta"].get("text", "") for name, e in events if name == "content_block_delta")
    assert text == "hi" and events[-1][0] == "message_stop"
    prompt = server.seen_text(start["usage"]["input_tokens"] + start["usage"].get("cache_read_input_tokens", 0))
    system_turn = prompt.split("<turn|>")[0]
    assert "<|think|>" in system_turn  # adaptive thinking on: the model has thought markers
    assert body["messages"][1]["content"].strip()[:200] in system_turn  # folded into the system turn
    assert body["system"][2]["text"].strip()[:200] in system_turn
    assert all(f"declaration:{t['name']}{{" in system_turn for t in body["tools"])
    assert 'type:<|"|><|"|>' not in system_turn  # every property typed (`template_fit`)


def test_system_messages_join_the_system_in_order():
    body = MessagesRequest.model_validate({
        "model": "any", "max_tokens": 5, "system": "First.",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Second."},
                     {"role": "assistant", "content": "Hello"}, {"role": "system", "content": [
                         {"type": "text", "text": "Third."}]}, {"role": "user", "content": "Bye"}]})
    messages, prefill = template_messages(body)
    assert messages == [{"role": "system", "content": "First.\n\nSecond.\n\nThird."},
                        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Bye"}] and not prefill


def _with_thoughts(context_management=None) -> list[dict]:
    turns = [{"role": "user", "content": "a"}]
    for i in range(3):
        turns += [{"role": "assistant", "content": [{"type": "thinking", "thinking": f"thought {i}", "signature": ""},
                                                    {"type": "text", "text": f"answer {i}"}]},
                  {"role": "user", "content": f"next {i}"}]
    body = {"model": "m", "max_tokens": 9, "messages": turns, "thinking": {"type": "adaptive"}}
    if context_management is not None:
        body["context_management"] = context_management
    messages, _ = template_messages(MessagesRequest.model_validate(body))
    return [m.get("reasoning_content") for m in messages if m["role"] == "assistant"]


def test_clear_thinking_keeps_the_thoughts_it_names():
    clear = "clear_thinking_20251015"
    assert _with_thoughts() == ["thought 0", "thought 1", "thought 2"]
    assert _with_thoughts({"edits": [{"type": clear, "keep": "all"}]}) == ["thought 0", "thought 1", "thought 2"]
    assert _with_thoughts({"edits": [{"type": clear}]}) == [None, None, "thought 2"]  # Anthropic's default
    assert _with_thoughts({"edits": [{"type": clear, "keep": {"type": "thinking_turns", "value": 2}}]}) == [
        None, "thought 1", "thought 2"]
    assert _with_thoughts({"edits": [{"type": "clear_tool_uses_20250919"}]}) == ["thought 0", "thought 1", "thought 2"]


def test_context_management_and_thinking_bad_values(served):
    server = served(TOOL_TEMPLATE, special_tokens=SPECIAL_TOKENS)  # no thought markers: it does not think
    ask = {"model": "claude-haiku-4-5", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    server.say("ok")
    adaptive = server.post("/v1/messages", {**ask, "thinking": {"type": "adaptive"}})
    assert adaptive.status_code == 200 and adaptive.json()["content"][0]["text"] == "ok"
    for extra, fragment in [({"context_management": {"edits": [{"type": "clear_everything"}]}},
                             "context_management.edits[0].type"),
                            ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 3}]}},
                             "context_management.edits[0].keep"),
                            ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}, {
                                "type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": -1}}]}},
                             "context_management.edits[1].keep: use"),
                            ({"thinking": {"type": "enabled", "budget_tokens": 2}}, "this model does not think"),
                            ({"thinking": {"type": "sometimes"}}, "thinking.type")]:
        response = server.post("/v1/messages", {**ask, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and fragment in error["message"], error


# -- model names and max tokens -------------------------------------------------------------


def test_any_model_name_is_answered_under_the_served_name(served):
    server = served(TOOL_TEMPLATE)
    server.say("ok")
    chat = server.post("/v1/chat/completions", {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == MODEL
    message = server.post("/v1/messages", {"model": "claude-opus-4-8", "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 200 and message.json()["model"] == MODEL
    strict = served(TOOL_TEMPLATE, strict_model_names=True)
    refused = strict.post("/v1/chat/completions", {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
def test_max_tokens_past_the_context_is_clamped_to_what_fits(route, served):
    server = served(TOOL_TEMPLATE, context=96)
    server.say("x" * 200)  # longer than the context: only the clamp ends it
    ask = {"model": MODEL, "max_tokens": 64000}
    if route == "chat":
        response = server.post("/v1/chat/completions", {**ask, "messages": [{"role": "user", "content": "hi"}]})
        answer = response.json()
        finish, usage = answer["choices"][0]["finish_reason"], answer["usage"]
        used = usage["prompt_tokens"] + usage["completion_tokens"]
    elif route == "completions":
        prompt = "<|turn>model\n"  # the script answers after a model turn's opener
        response = server.post("/v1/completions", {**ask, "prompt": prompt})
        answer = response.json()
        finish, usage = answer["choices"][0]["finish_reason"], answer["usage"]
        used = usage["prompt_tokens"] + usage["completion_tokens"]
    else:
        response = server.post("/v1/messages", {**ask, "messages": [{"role": "user", "content": "hi"}]})
        answer = response.json()
        finish, usage = answer["stop_reason"], answer["usage"]
        used = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage["output_tokens"]
    assert response.status_code == 200, response.text
    assert finish in ("length", "max_tokens") and used == 96, answer
    too_long = server.post("/v1/chat/completions", {**ask, "messages": [{"role": "user", "content": "y" * 200}]})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_left_out_max_tokens_runs_until_the_model_stops(served):
    """OpenAI's meaning (aider sends none): not the old 512-token default."""
    server = served(TOOL_TEMPLATE, context=4096)
    script = "ab" * 400
    server.say(script)
    answer = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert answer["choices"][0]["message"]["content"] == script
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] > 512
    capped = served(TOOL_TEMPLATE, context=4096, max_tokens=10)
    capped.say(script)
    short = capped.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 10


# -- opencode and alternation ---------------------------------------------------------------


def test_opencodes_title_request_on_a_template_that_alternates(served):
    """system, user, user: the two user messages become one turn (Gemma 3's template raises
    otherwise), the system text leading it as the template places it."""
    server = served(GEMMA_CHAT_TEMPLATE)
    body = recorded("opencode_title_request.json")
    body = {**body, "stream": False, "stream_options": None}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == MODEL
    prompt = server.seen_text(answer["usage"]["prompt_tokens"])
    first, second = body["messages"][1]["content"], body["messages"][2]["content"]
    assert prompt.count("<start_of_turn>user") == 1
    assert f"{first}\n\n{second}".strip() in prompt


def test_roles_merged_only_where_the_template_alternates(served):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "developer", "content": "Be brief."}, {"role": "assistant", "content": "c"},
                {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
    gemma3 = served(GEMMA_CHAT_TEMPLATE)
    answer = gemma3.post("/v1/chat/completions", {"model": MODEL, "messages": messages}).json()
    prompt = gemma3.seen_text(answer["usage"]["prompt_tokens"])
    assert prompt == ("<bos><start_of_turn>user\nBe brief.\n\na\n\nb<end_of_turn>\n<start_of_turn>model\nc\n\nd"
                      "<end_of_turn>\n<start_of_turn>user\ne<end_of_turn>\n<start_of_turn>model\n")
    gemma4 = served(google_template(GOOGLE[0]))
    gemma4.say("ok")
    answer = gemma4.post("/v1/chat/completions", {"model": MODEL, "messages": messages}).json()
    prompt = gemma4.seen_text(answer["usage"]["prompt_tokens"])
    assert prompt.count("<|turn>user") == 3 and "<|turn>system\nBe brief.<turn|>" in prompt  # as sent


@pytest.mark.parametrize("template", GOOGLE)
def test_opencodes_requests_on_gemma_4(template, served):
    server = served(google_template(template), context=32768)
    for name in ("opencode_title_request.json", "opencode_request.json"):
        server.say("ok")
        body = recorded(name)
        response = server.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "ok"
        assert chunks[-1]["usage"]["completion_tokens"] >= 2  # include_usage: the final chunk


@pytest.mark.parametrize("template", GOOGLE)
def test_an_assistant_turn_of_calls_only_and_developer_role(template, served):
    server = served(google_template(template))
    server.say("done")
    tools = [{"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Read a"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "text of a"}]
    response = server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "tools": tools})
    assert response.status_code == 200, response.text
    prompt = server.seen_text(response.json()["usage"]["prompt_tokens"])
    assert "Be brief.<|tool>declaration:read" in prompt.split("<turn|>")[0]  # developer = system
    assert '<|tool_call>call:read{path:<|"|>a<|"|>}<tool_call|><|tool_response>response:read{value:' in prompt


# -- tool schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("template", GOOGLE)
@pytest.mark.parametrize("agent", ["claude_code", "opencode"])
def test_recorded_tool_lists_render_typed_through_googles_templates(agent, template, tmp_path):
    """Every property of every recorded tool comes out with a type the format knows; no JSON
    Schema keyword is written as if it were a property's name."""
    tokenizer = load_tokenizer(save_tokenizer(tmp_path, google_template(template), GOOGLE_SPECIAL_TOKENS))
    tools = claude_tools() if agent == "claude_code" else recorded("opencode_request.json")["tools"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=walked_tools(tools),
                                         tokenize=False)
    declared = re.findall(r'type:<\|"\|>([^<]*)<\|"\|>', text)
    assert declared and set(declared) <= {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT"}, set(declared)
    for keyword in ("additionalProperties", "anyOf", "oneOf", "$schema", "$ref", "propertyNames"):
        assert f"{keyword}:" not in text and f"{keyword}<" not in text


def test_schemas_keep_their_meaning_in_the_walked_keys():
    definitions = {"Point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}
    schema = {"type": "object", "$defs": definitions, "required": ["status", "where", "gone"], "properties": {
        "status": {"description": "New status", "anyOf": [{"type": "string", "enum": ["pending", "done"]},
                                                          {"type": "string", "const": "deleted"}]},
        "where": {"$ref": "#/$defs/Point"},
        "maybe": {"type": ["integer", "null"]},
        "either": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "args": {"description": "Any value"},
        "meta": {"type": "object", "additionalProperties": {}, "propertyNames": {"type": "string"}},
        "opt": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]}}}
    assert walked_schema(schema, definitions) == {"type": "object", "required": ["status", "where"], "properties": {
        "status": {"type": "string", "enum": ["pending", "done", "deleted"], "description": "New status"},
        "where": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
        "maybe": {"type": "integer", "nullable": True},
        "either": {"type": "string", "description": "(one of: string, array)"},
        "args": {"type": "string", "description": "Any value (any JSON value)"},
        "meta": {"type": "object", "properties": {}},
        "opt": {"type": "object", "nullable": True, "properties": {"x": {"type": "number"}}, "required": ["x"]}}}
    cyclic = {"$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}},
              "$ref": "#/$defs/Node"}
    assert walked_schema(cyclic, cyclic["$defs"]) == {"type": "object", "properties": {
        "next": {"type": "object", "properties": {}}}}


# -- refusals -------------------------------------------------------------------------------


def test_refusals_are_logged_in_one_line_and_counted_by_reason(served, caplog):
    server = served(TOOL_TEMPLATE, context=96)
    assert httpx.head(server.base + "/", timeout=10).status_code == 200  # Claude Code's probe
    too_long = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "y" * 200}]})
    bad = server.post("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    nowhere = server.post("/v1/nowhere", {})
    assert (too_long.status_code, bad.status_code, nowhere.status_code) == (400, 400, 404)
    lines = [r.getMessage() for r in caplog.records if r.name == "mlx_spec.server"]
    assert lines[0].startswith("POST /v1/chat/completions 400 context_length_exceeded (messages): prompt is too long: ")
    assert lines[1].startswith("POST /v1/messages 400 invalid_request_error (max_tokens): ")
    assert lines[2].startswith("POST /v1/nowhere 404 invalid_request_error: Not Found")
    assert all("\n" not in line and "yyyy" not in line for line in lines)  # one line, no body
    metrics = httpx.get(server.base + "/metrics", timeout=10).text
    assert 'mlx_spec_refusals_total{code="400",reason="context_length_exceeded"} 1' in metrics
    assert 'mlx_spec_refusals_total{code="400",reason="invalid_request_error"} 1' in metrics
    assert 'mlx_spec_refusals_total{code="404",reason="invalid_request_error"} 1' in metrics


# -- special tokens -------------------------------------------------------------------------


def test_special_tokens_are_skipped_by_id_not_by_their_text(served):
    """Issue 42, item 7: a special token is left out by its id, as vLLM's detokenizer skips
    ids; the same text spelled in plain tokens (markup the model writes) is text, kept, with
    or without a grammar. Each token's log-prob `bytes` joined give the content exactly."""
    server = served(TOOL_TEMPLATE)
    plain = list(server.tokenizer.encode("<bos>", add_special_tokens=False, split_special_tokens=True))
    special = list(server.tokenizer.encode("<bos>", add_special_tokens=False))
    assert len(plain) == 5 and len(special) == 1
    words = lambda text: list(server.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    server.model.script = words("a") + plain + words("b") + special + words("c")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    chat = server.post("/v1/chat/completions", ask).json()["choices"][0]
    assert chat["message"]["content"] == "a<bos>bc"
    assert bytes(b for entry in chat["logprobs"]["content"] for b in entry["bytes"]).decode() == "a<bos>bc"
    named = [(entry["token"], entry["bytes"]) for entry in chat["logprobs"]["content"]]
    assert ("<bos>", []) in named  # the skipped token still named, adding no bytes
    kept = server.post("/v1/chat/completions", {**ask, "skip_special_tokens": False}).json()
    assert kept["choices"][0]["message"]["content"] == "a<bos>b<bos>c"
    # a call's end marker with no call open (a random model's) is the parser's, left out too
    server.model.script = words("a<tool_call|>b")
    assert server.post("/v1/chat/completions", ask).json()["choices"][0]["message"]["content"] == "ab"
    # under a grammar: a value spelling a control token's text keeps it (the grammar never draws the id)
    server.model.script = words('"x') + plain + words('"')
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}
    value = server.post("/v1/chat/completions", {**ask, "response_format": schema}).json()
    assert json.loads(value["choices"][0]["message"]["content"]) == "x<bos>"


def test_special_tokens_are_left_out_of_answers_unless_kept(served):
    """vLLM's `skip_special_tokens` (default true): control tokens the model writes are not
    text; a tool call's markers are still read (they are parsed before)."""
    server = served(TOOL_TEMPLATE)
    server.say("Hi <bos>there<|tool>!")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    chat = server.post("/v1/chat/completions", ask).json()
    assert chat["choices"][0]["message"]["content"] == "Hi there!"
    kept = server.post("/v1/chat/completions", {**ask, "skip_special_tokens": False}).json()
    assert kept["choices"][0]["message"]["content"] == "Hi <bos>there<|tool>!"
    streamed = server.post("/v1/chat/completions", {**ask, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Hi there!"
    message = server.post("/v1/messages", {**ask, "max_tokens": 50}).json()
    assert message["content"][0]["text"] == "Hi there!"
    completion = server.post("/v1/completions", {"model": MODEL, "prompt": "<|turn>model\n"}).json()
    assert completion["choices"][0]["text"] == "Hi there!"
    server.say('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>')
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = server.post("/v1/chat/completions", {**ask, "tools": tools}).json()["choices"][0]["message"]
    assert call["tool_calls"][0]["function"]["name"] == "get_weather" and not call["content"]
