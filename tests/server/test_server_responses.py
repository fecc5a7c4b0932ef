"""OpenAI's Responses API (`/v1/responses`, issue 42 item 1) through the official `openai`
client (`responses.create`, `.stream`, `.parse`) and raw HTTP where the bytes matter (Codex
CLI's own requests: test_server_codex.py).

The references are independent of the new route: the same conversation sent to chat
completions (its prompt, answer, calls, log-probs and usage must be the Responses answer's),
and the events of a stream added up by hand and by the SDK's accumulator (they must give the
final response). Most tests use `scripted_model.ScriptedModel` (its greedy answer is a
script, so a call is certain to come); greedy equality is also checked on a tiny
random-weight Gemma 4 drafted by a close copy (γ = 2). Each runs on our Gemma-4-shaped tool
template and on Google's own Gemma 4 template where tests/data/templates/ holds it (its
README.md says where it comes from).
"""

import json

import anthropic
import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from pydantic import BaseModel

import thinking_support
from mlx_spec.apps.runner import build_engine
from mlx_spec.loading import load_pair
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.server.responses_store import ResponseStore
from mlx_spec.testing.tiny import perturbed_copy
from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4, tiny_gemma4
from responses_support import (MODEL, Served, added_up, chat_tool, final_of, gemma4_templates, template_tokenizer,
                               without_ids)
from scripted_model import EOS_ID, END_OF_TURN_ID, InProcessServer, ScriptedModel, save_tokenizer
from server_support import assert_openai_error

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": PARAMETERS}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
PARIS = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
NOON = "<|tool_call>call:get_time{}<tool_call|>"
ASK = "Weather in Paris?"


@pytest.fixture(scope="module", params=list(gemma4_templates()))
def served(request, tmp_path_factory):
    served = Served(template_tokenizer(tmp_path_factory.mktemp(request.param), request.param), ScriptedModel())
    yield served
    served.server.stop()


def as_chat(served: Served, messages: list, **kwargs):
    """The same conversation through chat completions: (its answer, the prompt it made)."""
    answer = served.client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    return answer, served.prompt(answer.usage.prompt_tokens)


def events_of(served: Served, **kwargs) -> list:
    return list(served.client.responses.create(model=MODEL, stream=True, **kwargs))


# -- answers as chat completions gives them --------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_answer_is_the_chat_completions_answer(served, stream):
    served.say("Hello there, friend.")
    kwargs = dict(input=[{"role": "user", "content": "hi"}], instructions="Be brief.")
    if stream:
        events = events_of(served, **kwargs)
        response = final_of(events)
        assert added_up(events) == [item.model_dump(exclude_none=True) for item in response.output]
    else:
        response = served.client.responses.create(model=MODEL, **kwargs)
    prompt = served.prompt(response.usage.input_tokens)
    chat, chat_prompt = as_chat(served, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert response.status == "completed" and response.object == "response"
    assert response.output_text == chat.choices[0].message.content == "Hello there, friend."
    assert prompt == chat_prompt
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert response.model_extra["mlx_spec"]["drafter"] == "none"


def test_a_string_input_and_message_items_with_parts_make_one_prompt(served):
    served.say("Yes.")
    plain = served.client.responses.create(model=MODEL, input="Is it on?")
    first = served.prompt(plain.usage.input_tokens)
    parts = served.client.responses.create(model=MODEL, input=[{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Is it "}, {"type": "input_text", "text": "on?"}]}])
    assert served.prompt(parts.usage.input_tokens) == first and parts.output_text == plain.output_text == "Yes."


def test_developer_and_assistant_items_are_system_and_assistant_turns(served):
    served.say("Fine.")
    response = served.client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "How are you?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Good."}]},
        {"role": "user", "content": "And now?"}])
    prompt = served.prompt(response.usage.input_tokens)
    chat, chat_prompt = as_chat(served, [{"role": "system", "content": "Answer in one word."},
                                         {"role": "user", "content": "How are you?"},
                                         {"role": "assistant", "content": "Good."},
                                         {"role": "user", "content": "And now?"}])
    assert prompt == chat_prompt and response.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_chat_completions_calls_and_the_events_add_up(served, stream):
    served.say("Let me look. " + PARIS + NOON)
    kwargs = dict(input=ASK, tools=[WEATHER, TIME])
    if stream:
        events = events_of(served, **kwargs)
        response = final_of(events)
        assert added_up(events) == [item.model_dump(exclude_none=True) for item in response.output]
        kinds = [e.type for e in events]
        assert kinds.count("response.function_call_arguments.done") == 2
        with served.client.responses.stream(model=MODEL, **kwargs) as sdk_stream:
            for _ in sdk_stream:
                pass
            assert without_ids(sdk_stream.get_final_response().output) == without_ids(response.output)
    else:
        response = served.client.responses.create(model=MODEL, **kwargs)
    chat, chat_prompt = as_chat(served, [{"role": "user", "content": ASK}], tools=[chat_tool(WEATHER), chat_tool(TIME)])
    message = chat.choices[0].message
    assert served.prompt(response.usage.input_tokens) == chat_prompt
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert response.output[0].content[0].text == message.content == "Let me look. "
    assert [(c.name, json.loads(c.arguments)) for c in response.output[1:]] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    assert all(c.status == "completed" and c.call_id.startswith("call_") for c in response.output[1:])


def test_a_function_call_output_continues_as_a_tool_message_does(served):
    served.say(PARIS)
    first = served.client.responses.create(model=MODEL, input=ASK, tools=[WEATHER])
    [call] = first.output
    served.say("Sunny in Paris.")
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}]
    second = served.client.responses.create(model=MODEL, input=items, tools=[WEATHER])
    prompt = served.prompt(second.usage.input_tokens)
    chat, chat_prompt = as_chat(served, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"}], tools=[chat_tool(WEATHER)])
    assert prompt == chat_prompt and second.output_text == chat.choices[0].message.content == "Sunny in Paris."
    # The stored first response continues the same way from its id.
    third = served.client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert served.prompt(third.usage.input_tokens) == prompt and third.output_text == "Sunny in Paris."
    assert third.previous_response_id == first.id


def test_a_stored_conversation_goes_on_without_the_earlier_instructions(served):
    served.say("Hi.")
    first = served.client.responses.create(model=MODEL, input="Hello", instructions="Be terse.")
    second = served.client.responses.create(model=MODEL, input="Again", previous_response_id=first.id)
    chat, chat_prompt = as_chat(served, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                                         {"role": "user", "content": "Again"}])
    assert served.prompt(second.usage.input_tokens) == chat_prompt  # OpenAI's rule: not carried over


def test_namespaced_tools_are_offered_and_hosted_tools_left_out(served):
    """Codex's tool kinds: a `namespace` of functions (the call names its namespace) and the
    hosted `web_search`, which the model is not offered (the prompt is the one without it)."""
    served.say(NOON)
    tools = [WEATHER, {"type": "namespace", "name": "clock", "description": "Time tools", "tools": [TIME]},
             {"type": "web_search", "external_web_access": False}]
    response = served.client.responses.create(model=MODEL, input="What time is it?", tools=tools)
    [call] = response.output
    assert (call.name, call.namespace, call.arguments) == ("get_time", "clock", "{}")
    _, chat_prompt = as_chat(served, [{"role": "user", "content": "What time is it?"}],
                             tools=[chat_tool(WEATHER), chat_tool(TIME)])
    assert served.prompt(response.usage.input_tokens) == chat_prompt


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    served.say(PARIS + NOON)
    response = served.client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [item.name for item in response.output] == ["get_weather"] and response.parallel_tool_calls is False


def test_a_named_tool_choice_forces_that_call(served):
    served.say(PARIS.removeprefix("<|tool_call>"))  # what follows the start marker the prompt ends with
    response = served.client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME],
                                              tool_choice={"type": "function", "name": "get_weather"})
    chat, chat_prompt = as_chat(served, [{"role": "user", "content": ASK}], tools=[chat_tool(WEATHER), chat_tool(TIME)],
                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert served.prompt(response.usage.input_tokens) == chat_prompt
    calls = [(c.name, json.loads(c.arguments)) for c in response.output]
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_ends_an_incomplete_response(served, stream):
    served.say("one two three four five six seven")
    if stream:
        events = events_of(served, input="Count", max_output_tokens=5)
        response = final_of(events)
        assert events[-1].type == "response.incomplete"
        assert added_up(events) == [item.model_dump(exclude_none=True) for item in response.output]
    else:
        response = served.client.responses.create(model=MODEL, input="Count", max_output_tokens=5)
    chat, _ = as_chat(served, [{"role": "user", "content": "Count"}], max_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and chat.choices[0].finish_reason == "length"
    assert response.output_text == chat.choices[0].message.content and response.usage.output_tokens == 5


class Weather(BaseModel):
    city: str
    days: int


def test_parse_follows_a_pydantic_schema_as_chat_completions_does(served):
    served.say('{"city": "Paris", "days": 3}')
    parsed = served.client.responses.parse(model=MODEL, input=ASK, text_format=Weather)
    assert parsed.output_parsed == Weather(city="Paris", days=3)
    chat = served.client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                response_format=Weather)
    assert parsed.output_text == chat.choices[0].message.content
    with served.client.responses.stream(model=MODEL, input=ASK, text_format=Weather) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_parsed == Weather(city="Paris", days=3)


def test_logprobs_are_chat_completions_logprobs(served):
    served.say("Hello there.")
    response = served.client.responses.create(model=MODEL, input="hi", include=["message.output_text.logprobs"],
                                              top_logprobs=2)
    chat, _ = as_chat(served, [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)
    ours = [lp.model_dump(exclude_none=True) for lp in response.output[0].content[0].logprobs]
    theirs = [lp.model_dump(exclude_none=True) for lp in chat.choices[0].logprobs.content]
    assert ours == theirs and len(ours) == chat.usage.completion_tokens
    events = events_of(served, input="hi", include=["message.output_text.logprobs"], top_logprobs=2)
    assert added_up(events)[0]["content"][0]["logprobs"] == ours


@pytest.mark.parametrize("template", list(thinking_support.TEMPLATES))
def test_thoughts_are_reasoning_items(tmp_path, template):
    """Gemma 4's thought channel (`thinking_support`'s model, its template and Google's): a
    reasoning item before the message, streamed as reasoning_text deltas; reasoning.effort
    "none" turns it off."""
    tokenizer = thinking_support.tokenizer_for(tmp_path, thinking_support.TEMPLATES[template])
    served = Served(tokenizer, None, engine=thinking_support.thinking_engine(tokenizer))
    try:
        kwargs = dict(input=thinking_support.ASK, reasoning={"effort": "high", "summary": "auto"},
                      max_output_tokens=200)
        response = served.client.responses.create(model=MODEL, **kwargs)
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == thinking_support.THOUGHT
        assert response.output_text == thinking_support.ANSWER
        chat = served.client.chat.completions.create(model=MODEL, messages=thinking_support.ASK, max_tokens=200,
                                                     extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert chat.choices[0].message.model_extra["reasoning_content"] == reasoning.content[0].text
        assert chat.choices[0].message.content == response.output_text
        events = events_of(served, **kwargs)
        assert added_up(events) == [item.model_dump(exclude_none=True) for item in final_of(events).output]
        assert "response.reasoning_text.delta" in [e.type for e in events]
        off = served.client.responses.create(model=MODEL, input=thinking_support.ASK, reasoning={"effort": "none"})
        assert [item.type for item in off.output] == ["message"]
        # A reasoning item sent back is the next assistant turn's reasoning_content.
        again = served.client.responses.create(model=MODEL, max_output_tokens=200, input=[
            *thinking_support.ASK, reasoning.model_dump(exclude_none=True), message.model_dump(exclude_none=True),
            {"role": "user", "content": "And 3+3?"}])
        assert again.status == "completed"
    finally:
        served.server.stop()


# -- the store ------------------------------------------------------------------------------


def test_stored_responses_are_read_deleted_and_not_cancellable(served):
    served.say("Stored.")
    response = served.client.responses.create(model=MODEL, input="keep this")
    assert served.client.responses.retrieve(response.id).model_dump() == response.model_dump()
    with pytest.raises(openai.BadRequestError, match="background") as refused:
        served.client.responses.cancel(response.id)
    assert refused.value.body["param"] == "response_id"
    served.client.responses.delete(response.id)
    assert_openai_error(httpx.get(f"{served.base}/responses/{response.id}", timeout=10), 404, response.id)
    for method in ("GET", "DELETE"):
        assert_openai_error(httpx.request(method, f"{served.base}/responses/resp_none", timeout=10), 404)
    with pytest.raises(openai.NotFoundError):
        served.client.responses.cancel("resp_none")
    unstored = served.client.responses.create(model=MODEL, input="forget this", store=False)
    assert unstored.store is False
    assert_openai_error(httpx.get(f"{served.base}/responses/{unstored.id}", timeout=10), 404)
    error = assert_openai_error(served.post({"model": MODEL, "input": "x", "previous_response_id": unstored.id}), 404,
                                "not found")
    assert (error["param"], error["code"]) == ("previous_response_id", "previous_response_not_found")


def test_the_store_is_bounded_in_count_and_bytes():
    def response(n: int, size: int = 10) -> dict:
        return {"id": f"resp_{n}", "text": "x" * size}

    store = ResponseStore(max_count=3, max_bytes=10_000)
    for n in range(5):
        assert store.put(response(n), [])
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_4") is not None
    store = ResponseStore(max_count=100, max_bytes=10_000)
    assert not store.put(response(9, 20_000), [])  # alone past the bound: not kept
    for n in range(3):
        assert store.put(response(n), ["y" * 4_000])
    assert store.bytes <= 10_000 and len(store) == 2 and store.get("resp_0") is None
    assert store.delete("resp_2") and not store.delete("resp_2") and store.get("resp_2") is None
    assert len(store) == 1 and 4_000 < store.bytes < 5_000


# -- refusals -------------------------------------------------------------------------------


BAD = [  # (body fields over {"model", "input": "hi"}, the param named)
    ({"input": 3}, "input"),
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{oops"}],
      "tools": [WEATHER]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[1]"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "bogus"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict"),
    ({"tools": [{"type": "web_search"}, {"type": "namespace", "name": "n", "tools": [{**TIME, "strict": True}]}]},
     "tools[1].tools[0].strict"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"include": ["everything"]}, "include[0]"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"metadata": {"a": 1}}, "metadata.a"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[param for _, param in BAD])
def test_bad_values_are_refused_naming_the_parameter(served, fields, param):
    response = served.post({"model": MODEL, "input": "hi", **fields})
    error = assert_openai_error(response, 400)
    assert error["param"] == param, error


def test_any_model_name_is_answered_under_the_served_name(served):
    """As on the other routes (Codex names its own model): `--strict-model-names` is the 404."""
    response = served.post({"model": "gpt-5", "input": "hi", "max_output_tokens": 4})
    assert response.status_code == 200 and response.json()["model"] == MODEL


class FailingModel(ScriptedModel):
    """Raises at its `after`-th one-token forward: the worker fails the job (a 500)."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.steps = after, 0

    def __call__(self, inputs, cache=None):
        self.steps += inputs.shape[1] == 1
        if self.steps >= self.after:
            raise RuntimeError("the model broke")
        return super().__call__(inputs, cache)


def test_a_generation_that_fails_ends_with_response_failed(tmp_path):
    tokenizer = template_tokenizer(tmp_path, "tool-template")
    served = Served(tokenizer, FailingModel(after=4))
    try:
        served.say("one two three four five")
        events = events_of(served, input="Count")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "response.output_text.delta" in [e.type for e in events]
        failed = events[-1]
        assert failed.type == "response.failed" and failed.response.status == "failed"
        assert failed.response.error.code == "server_error" and "internal error" in failed.response.error.message
        assert_openai_error(served.post({"model": MODEL, "input": "Count"}), 500, "internal error")
    finally:
        served.server.stop()


def test_tools_on_a_template_without_a_call_format_are_refused(tmp_path):
    tokenizer = load_tokenizer(save_tokenizer(tmp_path, thinking_support.THINKING_TEMPLATE),
                               eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    served = Served(tokenizer, ScriptedModel())
    try:
        assert_openai_error(served.post({"model": MODEL, "input": "hi", "tools": [WEATHER]}), 400, "tool-call format")
        # Only tools the model is not offered: nothing to refuse.
        served.say("ok")
        assert served.post({"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}).status_code == 200
    finally:
        served.server.stop()


def test_anthropic_grammar_errors_name_output_config_format(served):
    """The grammar's refusal names the field the request used (it said response_format)."""
    client = anthropic.Anthropic(base_url=served.base.removesuffix("/v1"), api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"output_config": {"format": {"type": "json_schema",
                                                                        "schema": {"type": "nonsense"}}}})
    assert refused.value.body["error"]["message"].startswith("output_config.format: ")


# -- greedy answers on a drafted Gemma 4 -----------------------------------------------------


@pytest.fixture(scope="module", params=list(gemma4_templates()))
def gemma4(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-" + request.param)
    stops = [EOS_ID, END_OF_TURN_ID, TEMPLATE_SPECIAL_TOKENS.index("<|tool_response>")]
    target = tiny_gemma4(seed=0, eos_token_id=stops)
    for folder, model in (("target", target), ("draft", perturbed_copy(target, noise=0.02, seed=1))):
        save_tiny_gemma4(root / folder, model, chat_template=gemma4_templates()[request.param],
                         special_tokens=TEMPLATE_SPECIAL_TOKENS)
    pair = load_pair(str(root / "target"), str(root / "draft"), dtype="float32", progress=False)
    server = InProcessServer(create_app(build_engine(pair, "model"), pair.tokenizer,
                                        ServerOptions(model_name=MODEL, gamma="2")))
    yield server.client()
    server.stop()


CHAT_HISTORY = [{"role": "system", "content": "You help."}, {"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
RESPONSES_HISTORY = [{"role": "developer", "content": "You help."}, {"role": "user", "content": ASK},
                     {"type": "function_call", "call_id": "c1", "name": "get_weather",
                      "arguments": '{"city": "Paris"}'},
                     {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}]
SCHEMA = Weather.model_json_schema() | {"additionalProperties": False}
CASES = {  # name: (Responses fields, the chat completions request's)
    "text": ({"input": "one two one two", "instructions": "Count."},
             {"messages": [{"role": "system", "content": "Count."}, {"role": "user", "content": "one two one two"}]}),
    "tool-history": ({"input": RESPONSES_HISTORY, "tools": [WEATHER]},
                     {"messages": CHAT_HISTORY, "tools": [chat_tool(WEATHER)]}),
    "json-schema": ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}},
                    {"messages": [{"role": "user", "content": ASK}],
                     "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_answers_on_a_drafted_gemma4_are_chat_completions(gemma4, case, stream):
    fields, chat_fields = CASES[case]
    tokens = 24
    chat = gemma4.chat.completions.create(model=MODEL, temperature=0, max_tokens=tokens, **chat_fields)
    if stream:
        events = list(gemma4.responses.create(model=MODEL, temperature=0, max_output_tokens=tokens, stream=True,
                                              **fields))
        response = final_of(events)
        assert added_up(events) == [item.model_dump(exclude_none=True) for item in response.output]
    else:
        response = gemma4.responses.create(model=MODEL, temperature=0, max_output_tokens=tokens, **fields)
    message = chat.choices[0].message
    texts = [part.text for item in response.output if item.type == "message" for part in item.content]
    assert "".join(texts) == (message.content or "")
    assert [(c.name, c.arguments) for c in response.output if c.type == "function_call"] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.model_extra["mlx_spec"]["drafted"] > 0
    if case == "json-schema" and chat.choices[0].finish_reason == "stop":
        Weather.model_validate_json(response.output_text)
