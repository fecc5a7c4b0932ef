"""Structured output through the official clients against a served tiny random model (issue
34): OpenAI's `response_format` (json_schema via `chat.completions.parse` with a Pydantic
model, json_object), a strict forced tool's arguments, Anthropic's forced tool and
`output_config.format`; bad schemas are 400s naming the feature; grammar-forced tokens are
counted in the `mlx_spec` block and in /metrics.

The tokenizer is mlx-lm's over a byte-level vocabulary, with a template whose tool calls are
JSON (`<tool_call>{"name": ..., "arguments": ...}`), from which mlx-lm infers its json_tools
parser; every value is checked with `jsonschema`, not with our code."""

import json
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from mlx_lm.utils import load_tokenizer
from pydantic import BaseModel, Field
from scripted_model import InProcessServer, save_tokenizer
from server_support import assert_openai_error

from mlx_spec.core.engine import Engine
from mlx_spec.drafters import NgramDrafter
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.testing.tiny import END_OF_TURN_ID, EOS_ID, tiny_gemma3

MODEL = "tiny"
JSON_TOOL_TEMPLATE = (
    "{{ bos_token }}{%- if tools -%}{{ '<start_of_turn>system\\nTools:' }}"
    "{%- for tool in tools -%}{{ ' ' + tool.function.name }}{%- endfor -%}{{ '<end_of_turn>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}{%- if message.tool_calls -%}"
    "{%- for tool_call in message.tool_calls -%}{%- set tool_call = tool_call.function -%}"
    "{{ '<start_of_turn>model\\n<tool_call>{\"name\": \"' + tool_call.name + '\"}</tool_call><end_of_turn>\\n' }}"
    "{%- endfor -%}{%- else -%}"
    "{{ '<start_of_turn>' + message.role + '\\n' + message.content + '<end_of_turn>\\n' }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
CITY = {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Address(BaseModel):
    city: Annotated[str, Field(pattern="^[A-Z][a-z]{1,8}$")]
    postal_code: Annotated[str, Field(pattern="^[0-9]{5}$")]
    kind: Literal["home", "work"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer = load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("json-tools"), JSON_TOOL_TEMPLATE),
                               eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    assert tokenizer.tool_parser.__module__.endswith("json_tools")
    engine = Engine(tiny_gemma3(seed=0), NgramDrafter(), eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    served = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name=MODEL, gamma="3")))
    yield served
    served.stop()


def test_parse_with_a_pydantic_model(server):
    completion = server.client().chat.completions.parse(model=MODEL, messages=ASK, response_format=Address,
                                                        max_tokens=120)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Address) and completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), Address.model_json_schema())
    assert completion.model_extra["mlx_spec"]["grammar_forced"] > 5


def test_json_object(server):
    completion = server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, seed=3,
                                                         temperature=1.0, response_format={"type": "json_object"})
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].message.content), dict)
    else:  # a value cut by max_tokens says so
        assert completion.choices[0].finish_reason == "length"


def test_a_cut_value_says_length(server):
    completion = server.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": Address.model_json_schema()}})
    assert completion.choices[0].finish_reason == "length"


def test_a_strict_forced_tool_call_follows_its_schema(server):
    completion = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("body,status,fragments", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "dependentSchemas": {"a": {}}}}}}, 400, ["response_format", "dependentSchemas"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, 400, ["json_schema.schema"]),
    ({"response_format": {"type": "grammar"}}, 400, ["response_format.type"]),
    ({"tools": [WEATHER]}, 400, ["strict", "tool_choice"]),  # strict, but the call is not forced
])
def test_refusals_name_the_feature(server, body, status, fragments):
    response = httpx.post(server.base + "/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert_openai_error(response, status, *fragments)


def test_metrics_count_grammar_forced_tokens(server):
    server.client().chat.completions.parse(model=MODEL, messages=ASK, response_format=Address, max_tokens=120)
    text = httpx.get(server.base.removesuffix("/v1") + "/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("mlx_spec_grammar_forced_tokens_total"))
    assert float(line.split()[-1]) > 5


def anthropic_client(server):
    from anthropic import Anthropic

    return Anthropic(base_url=server.base.removesuffix("/v1"), api_key="unused", max_retries=0)


def test_anthropic_forced_tool_follows_its_input_schema(server):
    schema = WEATHER["function"]["parameters"]
    message = anthropic_client(server).messages.create(
        model=MODEL, max_tokens=120, messages=ASK,
        tools=[{"name": "get_weather", "input_schema": schema}], tool_choice={"type": "tool", "name": "get_weather"})
    block = next(b for b in message.content if b.type == "tool_use")
    assert message.stop_reason == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, schema)


def test_anthropic_output_format(server):
    schema = {**Address.model_json_schema(), "additionalProperties": False}  # else the model may add keys
    message = anthropic_client(server).messages.create(
        model=MODEL, max_tokens=120, messages=ASK,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_a_forced_tool_whose_schema_cannot_compile(server):
    """Issue 42: a forced call is constrained strict or not. A schema llguidance cannot take:
    a strict tool is a 400 naming the feature; one that is not strict is still a call to it,
    its arguments any object."""
    odd = {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}
    body = {"model": MODEL, "messages": ASK, "max_tokens": 80,
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    strict = httpx.post(server.base + "/chat/completions", timeout=60, json={
        **body, "tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": odd}}]})
    assert_openai_error(strict, 400, "tools", "dependentSchemas")
    completion = server.client().chat.completions.create(
        **body, seed=1, tools=[{"type": "function", "function": {"name": "f", "parameters": odd}}])
    assert completion.choices[0].finish_reason == "tool_calls"
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "f" and isinstance(json.loads(call.function.arguments), dict)
