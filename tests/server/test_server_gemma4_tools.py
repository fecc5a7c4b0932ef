"""Strict and forced tool calls in Gemma 4's own call syntax (issue 42, item 5).

Gemma 4 writes a call as `<|tool_call>call:NAME{key:value,...}<tool_call|>` (strings between
`<|"|>` delimiters, bare keys), not JSON, so a forced call's arguments follow a grammar
compiled from the tool's schema into that syntax (`server/call_grammars.py`). The references
are outside our code: Google's real Gemma 4 template (tests/data/templates/, see its README;
these tests skip without it) writes the calls the grammar must accept, mlx-lm's `gemma4`
parser reads what the grammar produces, `jsonschema` judges the arguments, and the official
`openai` and `anthropic` SDKs drive a tiny random-weight Gemma 4 carrying the template.
Greedy answers under drafting (a close copy of the target, γ 2) equal those of the target
alone.
"""

import json
import random
from typing import Literal, Optional

import anthropic
import jsonschema
import numpy as np
import pytest
from mlx_lm.tool_parsers import gemma4 as gemma4_parser
from mlx_lm.utils import load_tokenizer
from pydantic import BaseModel, Field
from scripted_model import InProcessServer
from server_support import assert_openai_error
from template_support import template_text

from mlx_spec.core.grammar import compile_grammar
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.server.call_grammars import CallGrammarError, gemma4_call_grammar
from mlx_spec.server.tools import tool_syntax

MODEL = "tiny-gemma4"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["celsius", "fahrenheit"]},
                   "hourly": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "strict": True, "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


class Stop(BaseModel):
    name: str = Field(max_length=12)
    minutes: Optional[int] = Field(default=None, ge=0, le=600)


class Trip(BaseModel):  # what instructor and pydantic-ai send: $defs, $ref, Optional, Literal, lists
    title: str = Field(max_length=20)
    mode: Literal["train", "bus", "ferry"]
    stops: list[Stop] = Field(max_length=2)
    price: Optional[float] = None


class TaggedTrip(Trip):  # a map: keys the schema does not list (a random model may write them forever)
    tags: dict[str, int] = Field(default_factory=dict, max_length=2)


SCHEMAS = {
    "weather": WEATHER_SCHEMA,
    "trip (pydantic)": TaggedTrip.model_json_schema(),
    "odd keys and unions": {"type": "object", "properties": {
        "first-name": {"type": ["string", "null"], "maxLength": 5}, "Ünïcode": {"const": "é<x>"},
        "any": {}, "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
                            "items": False},
        "either": {"anyOf": [{"type": "number", "maximum": 5}, {"type": "array", "items": {"type": "null"}, "maxItems": 2}]}},
        "required": ["first-name", "pair"]},
    "open object": {"type": "object", "properties": {"a": {"type": "boolean"}},
                    "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}},
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4, tiny_gemma4

    path = tmp_path_factory.mktemp("tokenizer")
    save_tiny_gemma4(path, tiny_gemma4(seed=0), chat_template=template_text("gemma4"),
                     special_tokens=TEMPLATE_SPECIAL_TOKENS)
    return load_tokenizer(path, eos_token_ids=[1, 5])


def grammar_for(tokenizer, tools):
    syntax = tool_syntax(tokenizer)
    assert syntax.grammar_format == "gemma4"
    return compile_grammar(tokenizer, "lark", gemma4_call_grammar(tools, syntax.end, dict(syntax.token_ids)),
                           [1, 5])


CLOSING = ("}", "]", ",", ":", '<|"|>', "<tool_call|>")


def random_call(tokenizer, grammar, rng: random.Random, limit: int = 600) -> str:
    """A random walk through the grammar: each step a token the grammar allows (one that
    closes something, a third of the time it may, so walks end), until it allows only the
    end (EOS) or, where it may end, by a coin."""
    matcher, path = grammar.matcher([1, 5]), []
    while len(path) < limit:
        allowed = np.nonzero(np.array(matcher.mask_after(path)))[0].tolist()
        words = [t for t in allowed if t not in (1, 5)]
        if not words or (len(words) < len(allowed) and rng.random() < 0.5):
            break
        closing = [t for t in words if tokenizer.decode([t]) in CLOSING]
        path.append(rng.choice(closing if closing and rng.random() < 0.3 else words))
    return tokenizer.decode(path)


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_call_the_grammar_allows_parses_and_validates(tokenizer, name):
    """mlx-lm's gemma4 parser reads each call the grammar lets through, and its arguments
    satisfy the schema (jsonschema); the walks reach the schema's options."""
    schema = SCHEMAS[name]
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    grammar, rng, keys = grammar_for(tokenizer, tools), random.Random(0), set()
    for _ in range(25):
        text = random_call(tokenizer, grammar, rng)
        assert text.endswith("<tool_call|>"), text
        call = gemma4_parser.parse_tool_call(text.removesuffix("<tool_call|>"))
        assert call["name"] == "f"
        jsonschema.validate(call["arguments"], schema)
        json.dumps(call["arguments"], allow_nan=False)  # strict JSON, as the server returns it
        keys |= set(call["arguments"])
    assert len(keys) > len(schema.get("required", [])), keys  # optional keys do appear


@pytest.mark.parametrize("arguments", [
    {"city": "Paris", "days": 3}, {"city": "Lyon", "days": 7, "unit": "celsius", "hourly": False}])
def test_the_grammar_accepts_the_calls_googles_template_writes(tokenizer, arguments):
    """A call as Google's template renders it in history is a complete path of the grammar."""
    history = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}]
    text = tokenizer._tokenizer.apply_chat_template(history, tools=[WEATHER], tokenize=False)
    written = text[text.index("<|tool_call>") + len("<|tool_call>"): text.index("<tool_call|>") + len("<tool_call|>")]
    ids = tokenizer.encode(written, add_special_tokens=False)
    matcher = grammar_for(tokenizer, [WEATHER]).matcher([1, 5])
    assert matcher.valid_prefix(ids) == len(ids)
    matcher.commit(ids)
    assert matcher.accepting and matcher.stopped


def test_a_schema_the_syntax_cannot_express_names_the_keyword():
    with pytest.raises(CallGrammarError, match="'not'"):
        gemma4_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}], "<tool_call|>", {})


# -- end to end: the official SDKs against a tiny Gemma 4 with Google's template ---------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(drafted, plain): the same tiny Gemma 4, drafted by a close copy at γ 2, and alone."""
    from mlx_spec.apps.runner import build_engine
    from mlx_spec.loading import load_pair
    from mlx_spec.testing.tiny import perturbed_copy
    from mlx_spec.testing.tiny_gemma4 import END_OF_TURN_ID, EOS_ID, TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4, tiny_gemma4

    root = tmp_path_factory.mktemp("gemma4-tools")
    stops = [EOS_ID, END_OF_TURN_ID, TEMPLATE_SPECIAL_TOKENS.index("<|tool_response>")]
    target = tiny_gemma4(seed=0, eos_token_id=stops)
    for folder, model in (("target", target), ("draft", perturbed_copy(target, noise=0.02, seed=1))):
        save_tiny_gemma4(root / folder, model, chat_template=template_text("gemma4"),
                         special_tokens=TEMPLATE_SPECIAL_TOKENS)
    pair = load_pair(str(root / "target"), str(root / "draft"), dtype="float32", progress=False)
    drafted = InProcessServer(create_app(build_engine(pair, "model"), pair.tokenizer,
                                         ServerOptions(model_name=MODEL, gamma="2")))
    plain = InProcessServer(create_app(build_engine(pair, None), pair.tokenizer,
                                       ServerOptions(model_name=MODEL, gamma="0")))
    yield drafted, plain
    drafted.stop()
    plain.stop()


def chat(server, **body):
    return server.client().chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 120,
                                                      "temperature": 0, **body})


def arguments_of(completion) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in completion.choices[0].message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_strict_forced_call_is_a_valid_call_exact_under_drafting(servers, tool_choice):
    drafted, plain = servers
    answers = [chat(server, tools=[TIME, WEATHER] if tool_choice != "required" else [WEATHER],
                    tool_choice=tool_choice) for server in servers]
    for answer in answers:
        assert answer.choices[0].finish_reason == "tool_calls"
        [(name, arguments)] = arguments_of(answer)
        assert name == "get_weather"
        jsonschema.validate(arguments, WEATHER_SCHEMA)
    assert arguments_of(answers[0]) == arguments_of(answers[1])
    assert answers[0].model_extra["mlx_spec"]["drafted"] > 0 and answers[0].model_extra["mlx_spec"]["grammar_forced"] > 0


def test_a_forced_named_tool_is_a_call_without_strict(servers):
    """instructor's Mode.TOOLS: a named tool, no `strict`: still a call that validates."""
    tool = {"type": "function", "function": {"name": "Trip", "parameters": Trip.model_json_schema()}}
    answer = chat(servers[0], tools=[tool], tool_choice={"type": "function", "function": {"name": "Trip"}}, max_tokens=300)
    [(name, arguments)] = arguments_of(answer)
    assert name == "Trip" and answer.choices[0].finish_reason == "tool_calls"
    Trip.model_validate(arguments)
    assert arguments_of(answer) == arguments_of(chat(servers[1], tools=[tool], max_tokens=300,
                                                     tool_choice={"type": "function", "function": {"name": "Trip"}}))


def test_streamed_call_equals_the_whole_one(servers):
    stream = servers[0].client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                                         tools=[WEATHER], tool_choice="required", stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = [(d.function.name, json.loads(d.function.arguments)) for delta in deltas for d in delta.tool_calls or []]
    assert streamed == arguments_of(chat(servers[0], tools=[WEATHER], tool_choice="required"))


def test_anthropic_forced_tools(servers):
    client = anthropic.Anthropic(base_url=servers[0].base.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}, {"name": "get_time", "input_schema": {"type": "object"}}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        message = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=tools, tool_choice=choice,
                                         extra_body={"temperature": 0})
        [block] = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use"
        if block.name == "get_weather":
            jsonschema.validate(block.input, WEATHER_SCHEMA)
        else:
            assert choice["type"] == "any" and isinstance(block.input, dict)


def test_responses_api_forced_strict_call(servers):
    response = servers[0].client().responses.create(
        model=MODEL, input="Weather in Paris?", max_output_tokens=120, temperature=0, tool_choice="required",
        tools=[{"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
               "parameters": WEATHER_SCHEMA}])
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert [("get_weather", json.loads(call.arguments))] == arguments_of(chat(servers[0], tools=[WEATHER], tool_choice="required"))


def test_unexpressible_schemas(servers):
    """A keyword Gemma's syntax cannot express: a strict tool is refused naming it; a tool
    that is not strict is still called, its arguments any object."""
    negated = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": negated}}
    import httpx

    refused = httpx.post(servers[0].base + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "tool_choice": "required",
        "tools": [TIME, {"type": "function", "function": {**tool["function"], "strict": True}}]})
    assert_openai_error(refused, 400, "tools[1].function.parameters", "'not'")
    answer = chat(servers[0], tools=[tool], tool_choice="required", max_tokens=60)
    if answer.choices[0].finish_reason == "tool_calls":  # a random model may fill the object past max_tokens
        [(name, arguments)] = arguments_of(answer)
        assert name == "f" and isinstance(arguments, dict)
    else:  # the grammar's call to f, cut short: the call's text
        assert answer.choices[0].finish_reason == "length"
        assert answer.choices[0].message.content.startswith("<|tool_call>call:f{")


def test_a_forced_call_with_thinking_on(servers):
    """Thinking on (`enable_thinking`, Anthropic's `thinking`): the prompt ends with the call's
    start marker, so no thought comes before it and the call is still the grammar's."""
    answer = chat(servers[0], tools=[WEATHER], tool_choice="required",
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    [(name, arguments)] = arguments_of(answer)
    assert name == "get_weather" and not answer.choices[0].message.model_extra.get("reasoning_content")
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    client = anthropic.Anthropic(base_url=servers[0].base.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60)
    message = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, tool_choice={"type": "any"},
                                     tools=[{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
                                     thinking={"type": "enabled", "budget_tokens": 50})
    [block] = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(block.input, WEATHER_SCHEMA)
