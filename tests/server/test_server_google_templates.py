"""The agent surface against Google's own Gemma 4 chat template (issue 30, item 1).

Google's template reads a tool's answer from the model's turn: `tool_responses` on the
assistant message that made the calls (`<|tool_response>response:NAME{...}<tool_response|>`),
with no new turn opened after it, where OpenAI sends `role: "tool"` messages and Anthropic
`tool_result` blocks. The server must render each conversation exactly as the template renders
the hand-written native form; the reference is transformers' `apply_chat_template` of that form.

The verbatim templates are read from tests/data/templates/ (see its README: their source and
licence, and why they are not committed); without them those cases skip. `NATIVE_TEMPLATE`
(ours, in the same native form) always runs. The model is `scripted_model.ScriptedModel`, so a
call is certain to come; the last test decodes a tiny random-weight Gemma 4 and compares with
mlx-lm's greedy `generate` of the native prompt.
"""

import json

import anthropic
import pytest
from mlx_lm.utils import load_tokenizer
from scripted_model import (
    END_OF_TURN_ID,
    EOS_ID,
    GOOGLE_SPECIAL_TOKENS,
    InProcessServer,
    ScriptedModel,
    save_tokenizer,
)
from template_support import (  # noqa: F401
    GOOGLE,
    NATIVE_TEMPLATE,
    SHA256,
    TEMPLATES,
    template_text,  # noqa: F401
)

from mlx_spec.core.engine import Engine
from mlx_spec.server import ServerOptions, create_app

MODEL = "scripted"
TOKENS = 10
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
LYON = '<|tool_call>call:get_weather{city:<|"|>Lyon<|"|>}<tool_call|>'
NOON = "<|tool_call>call:get_time{}<tool_call|>"



@pytest.fixture(scope="module", params=["native", *GOOGLE])
def served(request, tmp_path_factory):
    """(server, model, tokenizer) with the template as the checkpoint's own."""
    path = save_tokenizer(tmp_path_factory.mktemp(request.param), template_text(request.param),
                          GOOGLE_SPECIAL_TOKENS)
    tokenizer = load_tokenizer(path, eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    model = ScriptedModel()
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name=MODEL, gamma="0")))
    yield server, model, tokenizer
    server.stop()


def say(served, text):
    served[1].script = list(served[2].encode(text, add_special_tokens=False))


def native(served, messages, tools=(WEATHER, TIME), thinking=None) -> list[int]:
    """The template's own rendering (transformers') of the hand-written native form. Thinking
    is `thinking`, or by default switched as mlx-lm's tokenizer switches it (on where the
    vocabulary has the thinking channel's markers), which the OpenAI routes follow."""
    hf = served[2]._tokenizer
    return list(hf.apply_chat_template(messages, tools=list(tools) or None, add_generation_prompt=True,
                                       enable_thinking=served[2].has_thinking if thinking is None else thinking,
                                       tokenize=True, return_dict=False))


def seen_prompt(served, usage_tokens: int) -> list[int]:
    return served[1].seen[:usage_tokens]


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_the_template_takes_tools_and_its_calls_parse(served):
    tokenizer = served[2]
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<|tool_call>"
    say(served, PARIS + NOON)
    answer = served[0].client().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    calls = answer.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert seen_prompt(served, answer.usage.prompt_tokens) == native(served, ASK)


def test_openai_tool_messages_go_into_the_models_turn(served):
    """Parallel calls, their answers (text and a JSON object), a second round of calls in the
    same turn, the answer after it and the user's next turn: each prompt is the native form's."""
    client = served[0].client()
    say(served, PARIS + NOON)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    a, b = first.choices[0].message.tool_calls
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": a.id, "content": "Sunny, 24 C"},
                     {"role": "tool", "tool_call_id": b.id, "content": '{"time": "noon", "zone": 2}'}]
    say(served, LYON)
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME])
    [c] = second.choices[0].message.tool_calls
    first_turn = {"role": "assistant", "content": "", "tool_calls": [
        call(a.id, "get_weather", {"city": "Paris"}), call(b.id, "get_time", {})], "tool_responses": [
        {"name": "get_weather", "response": "Sunny, 24 C"}, {"name": "get_time", "response": {"time": "noon", "zone": 2}}]}
    assert seen_prompt(served, second.usage.prompt_tokens) == native(served, ASK + [first_turn])
    assert "<|tool_response>response:get_time{" in served[2].decode(served[1].seen)

    history += [second.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": c.id, "content": "Rain"}]
    say(served, "Sunny in Paris, rain in Lyon.")
    third = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME])
    assert third.choices[0].message.content == "Sunny in Paris, rain in Lyon."
    second_turn = {"role": "assistant", "content": "", "tool_calls": [call(c.id, "get_weather", {"city": "Lyon"})],
                   "tool_responses": [{"name": "get_weather", "response": "Rain"}]}
    assert seen_prompt(served, third.usage.prompt_tokens) == native(served, ASK + [first_turn, second_turn])

    history += [{"role": "assistant", "content": "Sunny in Paris, rain in Lyon."},
                {"role": "user", "content": "Thanks"}]
    say(served, "You are welcome.")
    fourth = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME])
    expected = ASK + [first_turn, {**second_turn, "content": "Sunny in Paris, rain in Lyon."},
                      {"role": "user", "content": "Thanks"}]
    assert seen_prompt(served, fourth.usage.prompt_tokens) == native(served, expected)


def test_anthropic_tool_results_go_into_the_models_turn(served):
    client = anthropic.Anthropic(base_url=served[0].base.removesuffix("/v1"), api_key="unused",
                                 max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    say(served, PARIS + NOON)
    first = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=tools)
    a, b = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and (a.name, a.input, b.name) == ("get_weather", {"city": "Paris"}, "get_time")
    say(served, "Sunny.")
    second = client.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=ASK + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": a.id, "content": "Sunny, 24 C"},
                                     {"type": "tool_result", "tool_use_id": b.id,
                                      "content": [{"type": "text", "text": "noon"}]}]}])
    assert second.content[0].text == "Sunny."
    expected = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        call(a.id, "get_weather", {"city": "Paris"}), call(b.id, "get_time", {})], "tool_responses": [
        {"name": "get_weather", "response": "Sunny, 24 C"}, {"name": "get_time", "response": "noon"}]}]
    anthropic_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                         "description": t["description"]}} for t in tools]
    prompt_tokens = second.usage.input_tokens + second.usage.cache_read_input_tokens
    # Anthropic's API thinks only when a request asks (`thinking: {type: "enabled"}`)
    assert seen_prompt(served, prompt_tokens) == native(served, expected, anthropic_tools, thinking=False)


@pytest.mark.parametrize("name", ["native", *GOOGLE])
def test_greedy_answers_after_tool_results_are_mlx_lms(name, tmp_path):
    """A tiny random-weight Gemma 4 carrying the template, drafted by a close copy: the greedy
    answer after a tool round trip, by either API, is mlx-lm's `generate` from the native
    form's prompt."""
    from mlx_lm import generate, load

    from mlx_spec.apps.runner import build_engine
    from mlx_spec.loading import load_pair
    from mlx_spec.testing.tiny import perturbed_copy
    from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4, tiny_gemma4

    template = template_text(name)
    # Gemma 4's generation config ends a turn at <|tool_response> too (the model hands over to a
    # tool there); the server stops there for the family, so mlx-lm must be told as well.
    stops = [EOS_ID, END_OF_TURN_ID, TEMPLATE_SPECIAL_TOKENS.index("<|tool_response>")]
    target = tiny_gemma4(seed=0, eos_token_id=stops)
    for folder, model in (("target", target), ("draft", perturbed_copy(target, noise=0.02, seed=1))):
        save_tiny_gemma4(tmp_path / folder, model, chat_template=template, special_tokens=TEMPLATE_SPECIAL_TOKENS)
    pair = load_pair(str(tmp_path / "target"), str(tmp_path / "draft"), dtype="float32", progress=False)
    engine = build_engine(pair, "model")
    server = InProcessServer(create_app(engine, pair.tokenizer, ServerOptions(model_name=MODEL, gamma="2")))
    try:
        # mlx-lm's text keeps control tokens: so do these answers (`skip_special_tokens`)
        openai_answer = server.client().chat.completions.create(model=MODEL, max_tokens=TOKENS, temperature=0,
                                                                extra_body={"skip_special_tokens": False}, messages=ASK + [
            {"role": "assistant", "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}')]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]).choices[0].message.content
        anthropic_answer = anthropic.Anthropic(base_url=server.base.removesuffix("/v1"), api_key="unused",
                                               max_retries=0, timeout=60).messages.create(
            model=MODEL, max_tokens=TOKENS, extra_body={"temperature": 0, "skip_special_tokens": False}, tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
            messages=ASK + [
                {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "Sunny"}]}],
        ).content[0].text
    finally:
        server.stop()
    model, tokenizer = load(str(tmp_path / "target"))
    turn = {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_weather", {"city": "Paris"})],
            "tool_responses": [{"name": "get_weather", "response": "Sunny"}]}
    # the OpenAI route thinks as mlx-lm's tokenizer does by default; Anthropic's only when asked
    for tools, thinking, answer in ((None, tokenizer.has_thinking, openai_answer), ([{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object"}}}], False, anthropic_answer)):
        prompt = tokenizer._tokenizer.apply_chat_template(ASK + [turn], tools=tools, add_generation_prompt=True,
                                                          enable_thinking=thinking, tokenize=True,
                                                          return_dict=False)
        assert answer == generate(model, tokenizer, prompt, max_tokens=TOKENS)
