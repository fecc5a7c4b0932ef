"""The Anthropic Messages API (`POST /v1/messages`) through the official `anthropic` SDK
against live servers (issue 19, item 4): a tiny Gemma 3 pair in a subprocess (greedy text
equals mlx-lm's and the OpenAI route's) and the scripted model in-process (tool round trip,
stop sequences, keys), streamed and not."""

import json

import anthropic
import httpx
import pytest
from mlx_lm import generate, load
from mlx_lm.utils import load_tokenizer
from scripted_model import END_OF_TURN_ID, EOS_ID, InProcessServer, ScriptedModel, save_tokenizer
from server_support import server_env, serving

from mlx_spec.core.engine import Engine
from mlx_spec.server import ServerOptions, create_app

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

MODEL = "scripted"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments; the API takes them
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
BODY = CALL.removeprefix("<|tool_call>")  # what a model writes after a forced call's start marker
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                           "description": WEATHER["description"]}}]  # WEATHER as templates take it


@pytest.fixture(scope="module")
def spec_server(tiny_dirs, cost_cache):
    target, draft = tiny_dirs
    yield from serving(["--model", target, "--draft-model", draft, "--gamma", "2"], server_env(cost_cache))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("scripted")),
                          eos_token_ids=[EOS_ID, END_OF_TURN_ID])


@pytest.fixture(scope="module")
def scripted(tokenizer):
    model = ScriptedModel()
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(
        model_name=MODEL, gamma="0", api_key="sekret")))
    server.model = model
    yield server
    server.stop()


def client_for(base: str, key: str = "unused"):
    return anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=key, max_retries=0, timeout=60)


def say(server, tokenizer, text):
    server.model.script = list(tokenizer.encode(text, add_special_tokens=False))


def test_greedy_text_equals_mlx_lm_and_the_openai_route(spec_server, tiny_dirs):
    model, tokenizer = load(tiny_dirs[0])
    client = client_for(spec_server.base)
    system, question = "Answer briefly.", "Tell me a story"
    message = client.messages.create(model=tiny_dirs[0], max_tokens=20, extra_body=GREEDY, system=system,
                                     messages=[{"role": "user", "content": question}])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    expected = generate(model, tokenizer, ids, max_tokens=20)
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)
    openai_answer = spec_server.client().chat.completions.create(model=tiny_dirs[0], messages=messages,
                                                                 max_tokens=20, temperature=0)
    assert openai_answer.choices[0].message.content == expected
    assert message.usage.output_tokens == openai_answer.usage.completion_tokens

    with client.messages.stream(model=tiny_dirs[0], max_tokens=20, extra_body=GREEDY, system=[{"type": "text", "text": system}],
                                messages=[{"role": "user", "content": [{"type": "text", "text": question}]}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and final.content[0].text == expected
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens
    # a second identical request reads its prompt from the cache
    again = client.messages.create(model=tiny_dirs[0], max_tokens=2, extra_body=GREEDY, system=system,
                                   messages=[{"role": "user", "content": question}])
    assert again.usage.cache_read_input_tokens == len(ids) - 1


def test_errors_in_anthropics_shape(spec_server, tiny_dirs):
    client = client_for(spec_server.base)
    with pytest.raises(anthropic.NotFoundError) as error:  # an unknown route
        client.get("/v1/messages/nope", cast_to=object)
    assert error.value.body["error"]["type"] == "not_found_error"
    base = spec_server.url + "/v1/messages"
    cases = [({"model": tiny_dirs[0], "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
             ({"model": tiny_dirs[0], "max_tokens": 5, "messages": []}, "messages"),
             ({"model": tiny_dirs[0], "max_tokens": 5, "temperature": 1.5,
               "messages": [{"role": "user", "content": "hi"}]}, "temperature"),
             ({"model": tiny_dirs[0], "max_tokens": 5, "messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]},
              "messages[0].content[0]: image"),
             ({"model": tiny_dirs[0], "max_tokens": 5, "tools": [WEATHER],
               "messages": [{"role": "user", "content": "hi"}]}, "no tool-call format"),
             ({"model": tiny_dirs[0], "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024},
               "messages": [{"role": "user", "content": "hi"}]}, "thinking: this model does not think"),
             ({"model": tiny_dirs[0], "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
               "messages": [{"role": "user", "content": "hi"}]}, "tools[0].type")]
    for body, fragment in cases:
        response = httpx.post(base, json=body, timeout=30)
        assert response.status_code == 400, response.text
        data = response.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
        assert fragment in data["error"]["message"] and "\n" not in data["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=tiny_dirs[0], max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": -1})


def test_keys_stop_sequences_and_count_tokens(scripted, tokenizer):
    with pytest.raises(anthropic.AuthenticationError) as error:
        client_for(scripted.base, "wrong").messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["error"]["type"] == "authentication_error"
    client = client_for(scripted.base, "sekret")  # sent as x-api-key
    say(scripted, tokenizer, "Hello world. STOP here")
    message = client.messages.create(model=MODEL, max_tokens=30, stop_sequences=["NEVER", "STOP"],
                                     messages=[{"role": "user", "content": "hi"}])
    assert message.content[0].text == "Hello world. "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    short = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert short.content[0].text == "Hel" and short.stop_reason == "max_tokens"
    count = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert count.input_tokens == len(ids)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_tool_round_trip(streamed, scripted, tokenizer):
    client = client_for(scripted.base, "sekret")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    say(scripted, tokenizer, "Checking." + CALL)
    if streamed:
        with client.messages.stream(model=MODEL, max_tokens=100, tools=[WEATHER], messages=ask) as stream:
            kinds = [e.type for e in stream]
            first = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "content_block_start" in kinds and "message_delta" in kinds
    else:
        first = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], messages=ask)
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.type == "text" and text.text == "Checking."
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")

    turn = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "Sunny"}]}]}]
    say(scripted, tokenizer, "It is sunny.")
    second = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], messages=turn)
    assert second.content[0].text == "It is sunny." and second.stop_reason == "end_turn"
    expected = ask + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": use.id, "name": "get_weather", "content": "Sunny"}]
    prompt = list(tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True))
    assert scripted.model.seen[: len(prompt)] == prompt
    say(scripted, tokenizer, CALL + CALL.replace("Paris", "Rome"))
    both = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], messages=ask)
    assert [b.input["city"] for b in both.content] == ["Paris", "Rome"]
    one = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], messages=ask,
                                 tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.input["city"] for b in one.content] == ["Paris"]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_tool_choice_forces_a_call(streamed, scripted, tokenizer):
    """"any" and a named tool end the prompt with the start marker, so the model writes only
    the call's body (BODY); were the marker missing, those words would be text, as with "auto"."""
    client = client_for(scripted.base, "sekret")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    say(scripted, tokenizer, BODY)

    def answer(tool_choice):
        request = dict(model=MODEL, max_tokens=100, tools=[WEATHER], messages=ask, tool_choice=tool_choice,
                       extra_body={"skip_special_tokens": False})  # the free answer's text as written
        if not streamed:
            return client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            return stream.get_final_message()

    for tool_choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        forced = answer(tool_choice)
        assert [b.type for b in forced.content] == ["tool_use"] and forced.stop_reason == "tool_use"
        assert (forced.content[0].name, forced.content[0].input) == ("get_weather", {"city": "Paris"})
        prompt = list(tokenizer.apply_chat_template(ask, tools=TOOLS, add_generation_prompt=True))
        prompt += tokenizer.encode("<|tool_call>", add_special_tokens=False)
        assert scripted.model.seen[: len(prompt)] == prompt
    free = answer({"type": "auto"})
    assert [(b.type, b.text) for b in free.content] == [("text", BODY)] and free.stop_reason == "end_turn"


@pytest.mark.parametrize("where, value", [
    ("input", '{"days": ' + "1" * 5000 + "}"),  # past Python's limit for int("...")
    ("input", "[" * 100_000 + "]" * 100_000),
    ("input", '{"days": NaN}'),
    ("input", '{"city": "\\ud800"}'),
    ("input_schema", '{"type": "object", "maximum": ' + "1" * 5000 + "}"),
], ids=["long-integer", "deep", "nan", "lone-surrogate", "schema-long-integer"])
def test_malformed_tool_input_or_schema_is_a_400(where, value, scripted):
    """Issue 32: a tool_use block's input (or a tool's input_schema) that is not strict JSON is
    a 400 in Anthropic's shape, not a 500."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                   "input": "@input"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]}]
    body = json.dumps({"model": MODEL, "max_tokens": 5, "messages": messages,
                       "tools": [{**WEATHER, "input_schema": "@input_schema"}]})
    for name, good in {"input": "{}", "input_schema": json.dumps(WEATHER["input_schema"])}.items():
        body = body.replace(f'"@{name}"', value if name == where else good)
    response = httpx.post(scripted.base.removesuffix("/v1") + "/v1/messages", content=body, timeout=30,
                          headers={"x-api-key": "sekret", "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    data = response.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
    assert "\n" not in data["error"]["message"] and "Traceback" not in response.text


# -- issue 32 ------------------------------------------------------------------------------


def test_streamed_usage_counts_cached_tokens_once(spec_server, tiny_dirs):
    """The SDK's final message of a stream reads the same usage as the whole answer, the
    prompt read from the cache: input and cache reads come once, in message_start."""
    client = client_for(spec_server.base)
    request = dict(model=tiny_dirs[0], max_tokens=6, extra_body=GREEDY, system="Count.",
                   messages=[{"role": "user", "content": "one two three four"}])
    first = client.messages.create(**request)  # fills the cache
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message().usage
    whole = client.messages.create(**request).usage
    assert whole.cache_read_input_tokens > 0 and whole.input_tokens == 1
    assert (streamed.input_tokens, streamed.cache_read_input_tokens, streamed.output_tokens) == \
        (whole.input_tokens, whole.cache_read_input_tokens, whole.output_tokens)
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert streamed.input_tokens + streamed.cache_read_input_tokens == prompt


HI = {"role": "user", "content": "hi"}
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                         "input": {"city": "Paris"}}]}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]}


@pytest.mark.parametrize("body, fragment", [
    ({"messages": [{"role": "user", "content": []}]}, "messages[0]: all messages must have non-empty content"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0]: all messages must have non-empty content"),
    ({"messages": [HI, {"role": "assistant", "content": []}, HI]}, "messages[1]: all messages must have non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages[0].content[0].text: text content blocks must be non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0]: a text block needs a string `text`"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text: Input should be a valid string"),
    ({"system": [{"type": "text"}], "messages": [HI]}, "system[0]: a text block needs a string `text`"),
    ({"messages": [HI], "tool_choice": {"type": "any"}}, "tool_choice: forcing a tool call needs tools"),
    ({"messages": [HI], "tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice: forcing"),
    ({"messages": [HI, USE, RESULT]}, "messages[1].content[0]: requests which include `tool_use`"),
    ({"messages": [HI, USE, {"role": "user", "content": [{**RESULT["content"][0], "tool_use_id": "t9"}]}],
      "tools": [WEATHER]}, "messages[2].content[0]: a tool_result block must answer a tool_use"),
    ({"messages": [RESULT], "tools": [WEATHER]}, "messages[0].content[0]: a tool_result block must answer"),
    ({"messages": [HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "input": {}}]}, RESULT],
      "tools": [WEATHER]}, "messages[1].content[0]: a tool_use block needs an `id` and a `name`"),
], ids=["empty-list", "empty-string", "empty-assistant", "empty-text", "text-missing", "text-not-a-string",
        "system-text-missing", "any-without-tools", "tool-without-tools", "blocks-without-tools",
        "unknown-tool-use-id", "result-first", "use-without-name"])
def test_bad_messages_are_refused_naming_the_place(body, fragment, scripted):
    """Issue 32: as Anthropic's API refuses them, in its error shape, on both routes."""
    for path in ("", "/count_tokens"):
        response = httpx.post(scripted.base + "/messages" + path, timeout=30, headers={"x-api-key": "sekret"},
                              json={"model": MODEL, "max_tokens": 5, **body})
        assert response.status_code == 400, response.text
        data = response.json()
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        assert fragment in data["error"]["message"] and "\n" not in data["error"]["message"], data


def test_an_empty_final_assistant_turn_is_no_prefill(scripted, tokenizer):
    say(scripted, tokenizer, "Hello.")
    client = client_for(scripted.base, "sekret")
    message = client.messages.create(model=MODEL, max_tokens=30, messages=[HI, {"role": "assistant", "content": []}])
    assert message.content[0].text == "Hello."
    prompt = list(tokenizer.apply_chat_template([HI], add_generation_prompt=True))
    assert scripted.model.seen[: len(prompt)] == prompt
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)
