"""Tool calling through the official `openai` client against a live server (issue 19, item 1).

The model is `scripted.ScriptedModel`, whose greedy answer is a script the test sets, so a
call (well-formed or not) is certain to come; the tokenizer is mlx-lm's, with a Gemma-4-shaped
template that renders tools, from which mlx-lm infers its `gemma4` tool parser. The chat
template, the parser, the engine and the HTTP path are the real ones."""

import json

import pytest
from mlx_lm.utils import load_tokenizer

from mlx_spec.engine import Engine
from mlx_spec.server import ServerOptions, create_app
from scripted_model import EOS_ID, END_OF_TURN_ID, InProcessServer, ScriptedModel, save_tokenizer
from server_support import assert_openai_error

MODEL = "scripted"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
BODY = CALL.removeprefix("<|tool_call>")  # what a model writes after a forced call's start marker
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = save_tokenizer(tmp_path_factory.mktemp("scripted"))
    return load_tokenizer(path, eos_token_ids=[EOS_ID, END_OF_TURN_ID])


@pytest.fixture(scope="module")
def served(tokenizer):
    model = ScriptedModel()
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name=MODEL, gamma="0")))
    yield server, model
    server.stop()


def say(served, tokenizer, text):
    """Make the model's next answer `text`."""
    served[1].script = list(tokenizer.encode(text, add_special_tokens=False))


def rendered(tokenizer, messages, tools=None):
    """mlx-lm's rendering of the conversation (the prompt the model must have seen)."""
    extra = {"tools": tools} if tools else {}
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra))


def test_mlx_lm_infers_the_gemma4_parser(tokenizer):
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<|tool_call>"


def test_a_call_whole_and_streamed(served, tokenizer):
    server, model = served
    client = server.client()
    say(served, tokenizer, "Let me check." + CALL)
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    prompt = rendered(tokenizer, ASK, [WEATHER, TIME])
    assert model.seen[: len(prompt)] == prompt and answer.usage.prompt_tokens == len(prompt)

    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True,
                                                 temperature=0))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert text == "Let me check."
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris", "days": 3})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_parallel_tool_calls_false_keeps_the_first_call(served, tokenizer):
    client = served[0].client()
    say(served, tokenizer, CALL + "<|tool_call>call:get_time{}<tool_call|>")
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                            parallel_tool_calls=False)
    assert [c.function.name for c in answer.choices[0].message.tool_calls] == ["get_weather"]
    assert answer.choices[0].message.content is None and answer.choices[0].finish_reason == "tool_calls"


def test_two_calls_and_the_tool_round_trip(served, tokenizer):
    server, model = served
    client = server.client()
    say(served, tokenizer, CALL + "<|tool_call>call:get_time{}<tool_call|>")
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    calls = first.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert first.choices[0].message.content is None
    turn = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 24 C"},
                  {"role": "tool", "tool_call_id": calls[1].id, "content": [{"type": "text", "text": "noon"}]}]
    say(served, tokenizer, "It is sunny in Paris.")
    second = client.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER, TIME])
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    expected = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
            {"id": calls[1].id, "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "name": "get_weather", "content": "Sunny, 24 C"},
        {"role": "tool", "tool_call_id": calls[1].id, "name": "get_time", "content": "noon"}]
    prompt = rendered(tokenizer, expected, [WEATHER, TIME])
    assert "response:get_weather{value:<|\"|>Sunny, 24 C" in tokenizer.decode(prompt)
    assert model.seen[: len(prompt)] == prompt and second.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("output", [
    '<|tool_call>call:get_weather{city:<|"|>Par',  # cut off: no end marker
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:}<tool_call|>',  # not JSON
    '<|tool_call>call:launch_missiles{}<tool_call|>',  # a function nobody offered
    'Almost <|tool_ca',  # a marker's beginning at the end
], ids=["truncated", "bad-arguments", "unknown-function", "partial-marker"])
def test_a_malformed_call_is_text(output, served, tokenizer):
    server, _ = served
    client = server.client()
    say(served, tokenizer, output)
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    assert answer.choices[0].message.content == output and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == output
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_tool_choice(streamed, served, tokenizer):
    """Forcing ends the prompt with the start marker, so the model writes only the call's body
    (BODY); were the marker missing, those words would be text, as with "none"."""
    server, model = served
    client = server.client()
    start = tokenizer.encode("<|tool_call>", add_special_tokens=False)
    say(served, tokenizer, BODY)

    def ask(tools, tool_choice):
        """(content, [(name, arguments)], finish_reason) of one answer."""
        request = dict(model=MODEL, messages=ASK, tools=tools, tool_choice=tool_choice)
        if not streamed:
            choice = client.chat.completions.create(**request).choices[0]
            calls = choice.message.tool_calls or []
            return (choice.message.content, [(c.function.name, json.loads(c.function.arguments)) for c in calls],
                    choice.finish_reason)
        chunks = [c for c in client.chat.completions.create(**request, stream=True) if c.choices]
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        return ("".join(c.choices[0].delta.content or "" for c in chunks) or None,
                [(d.function.name, json.loads(d.function.arguments)) for d in deltas], chunks[-1].choices[0].finish_reason)

    weather = [("get_weather", {"city": "Paris", "days": 3})]
    assert ask([WEATHER, TIME], "required") == (None, weather, "tool_calls")
    prompt = rendered(tokenizer, ASK, [WEATHER, TIME]) + start
    assert model.seen[: len(prompt)] == prompt
    # a named function: only it is shown to the model
    assert ask([TIME, WEATHER], {"type": "function", "function": {"name": "get_weather"}}) == (None, weather, "tool_calls")
    prompt = rendered(tokenizer, ASK, [WEATHER]) + start
    assert model.seen[: len(prompt)] == prompt
    # none: no tools in the prompt, and the answer is text whatever it says
    assert ask([WEATHER], "none") == (BODY, [], "stop")
    prompt = rendered(tokenizer, ASK)
    assert model.seen[: len(prompt)] == prompt


def test_bad_tool_requests(served):
    import httpx

    server, _ = served

    def post(body):
        return httpx.post(server.base + "/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=30)

    assert_openai_error(post({"tools": [{"type": "function", "function": {"name": ""}}]}), 400, "tools[0].function.name")
    assert_openai_error(post({"tools": [{"type": "retrieval"}]}), 400, "tools[0].type")
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    error = assert_openai_error(post({"tools": [strict]}), 400, "tools[0].function.strict", "not supported")
    assert error["code"] == "unsupported_parameter"
    assert_openai_error(post({"tools": [WEATHER], "tool_choice": "sometimes"}), 400, "tool_choice")
    assert_openai_error(post({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                        400, "no tool is named 'nope'")
    bad_args = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]
    assert_openai_error(post({"messages": bad_args}), 400, "messages[1].tool_calls[0].function.arguments", "JSON")
    assert_openai_error(post({"messages": ASK + [{"role": "tool", "content": "x"}]}), 400, "tool_call_id")
