"""pydantic-ai and instructor, the real libraries from PyPI, against `serve` on tiny random
Gemma 3 and Gemma 4 models (issue 42, item 5). Each asks for a Pydantic model the way it does
by default: pydantic-ai's default output (a forced output tool, `tool_choice: required`, strict
where the schema allows) and `NativeOutput` (`response_format` json_schema); instructor's
`Mode.TOOLS` (a named tool, no `strict`) and `Mode.JSON_SCHEMA`. The answer must be the
model, validated by the library itself, at the first try (no retries allowed).

Gemma 4 carries Google's real template (tests/data/templates/; skipped without it); Gemma 3
ours, which has no call format, so a forced call is answered as the arguments' JSON.
Skipped where the libraries are not installed (`pip install instructor pydantic-ai-slim[openai]`).
"""

import json
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, Field
from scripted_model import InProcessServer
from template_support import template_text

from mlx_spec.server import ServerOptions, create_app

MODEL = "tiny"
PROMPT = "Plan a short trip."


class Stop(BaseModel):
    name: str = Field(max_length=12)
    minutes: Optional[int] = Field(default=None, ge=0, le=600)


class Trip(BaseModel):
    title: str = Field(max_length=20)
    mode: Literal["train", "bus", "ferry"]
    stops: list[Stop] = Field(max_length=2)


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def server(request, tmp_path_factory):
    from mlx_spec.apps.runner import build_engine
    from mlx_spec.loading import load_pair
    from mlx_spec.testing.tiny import perturbed_copy, save_tiny_model, tiny_gemma3
    from mlx_spec.testing.tiny_gemma4 import TEMPLATE_SPECIAL_TOKENS, save_tiny_gemma4, tiny_gemma4

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma4":
        template = template_text("gemma4")
        target = tiny_gemma4(seed=0)
        for folder, model in (("target", target), ("draft", perturbed_copy(target, noise=0.02, seed=1))):
            save_tiny_gemma4(root / folder, model, chat_template=template, special_tokens=TEMPLATE_SPECIAL_TOKENS)
    else:
        target = tiny_gemma3(seed=0)
        for folder, model in (("target", target), ("draft", perturbed_copy(target, noise=0.02, seed=1))):
            save_tiny_model(root / folder, model)
    pair = load_pair(str(root / "target"), str(root / "draft"), dtype="float32", progress=False)
    served = InProcessServer(create_app(build_engine(pair, "model"), pair.tokenizer,
                                        ServerOptions(model_name=MODEL, gamma="2", max_tokens=400)))
    yield served
    served.stop()


def openai_client(server, sent: list):
    """The official client, recording each request body it sends in `sent`."""
    import httpx
    from openai import OpenAI

    hook = {"request": [lambda request: sent.append(json.loads(request.content))]}
    return OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120,
                  http_client=httpx.Client(event_hooks=hook))


def pydantic_ai_agent(server, output_type, sent: list):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    import httpx
    from openai import AsyncOpenAI

    async def record(request):
        sent.append(json.loads(request.content))

    client = AsyncOpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120,
                         http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
    return Agent(model, output_type=output_type, retries=0,
                 model_settings={"temperature": 0.0, "max_tokens": 400})


class City(BaseModel):  # every field required: a schema OpenAI's strict mode takes
    name: str = Field(max_length=12)
    country: Literal["France", "Japan"]


@pytest.mark.parametrize("output", [Trip, City])
def test_pydantic_ai_default_output(server, output):
    sent = []
    result = pydantic_ai_agent(server, output, sent).run_sync(PROMPT)
    assert isinstance(result.output, output)
    [body] = sent  # one request: its output tool, forced (pydantic-ai 2.38 marks it strict for no name here)
    assert body["tool_choice"] == "required" and body["tools"][0]["function"]["name"] == "final_result"


def test_pydantic_ai_native_output(server):
    NativeOutput = pytest.importorskip("pydantic_ai").NativeOutput

    sent = []
    result = pydantic_ai_agent(server, NativeOutput(Trip), sent).run_sync(PROMPT)
    assert isinstance(result.output, Trip)
    [body] = sent
    assert body["response_format"]["type"] == "json_schema"


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(server, mode):
    instructor = pytest.importorskip("instructor")
    sent = []
    client = instructor.from_openai(openai_client(server, sent), mode=getattr(instructor.Mode, mode))
    trip = client.chat.completions.create(model=MODEL, response_model=Trip, max_retries=0, temperature=0,
                                          max_tokens=400, messages=[{"role": "user", "content": PROMPT}])
    assert isinstance(trip, Trip)
    [body] = sent
    if mode == "TOOLS":  # a named tool, not strict
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Trip"}}
        assert not body["tools"][0]["function"].get("strict")
    else:
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "Trip"}}])
def test_forced_calls_through_the_openai_sdk(server, tool_choice):
    """What the libraries rely on, with the official SDK alone: a forced call is a call whose
    arguments validate (jsonschema), on Gemma 3 too, whose template has no call format."""
    import jsonschema

    tools = [{"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
             for name, model in (("Trip", Trip), ("City", City))]
    answer = openai_client(server, []).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=tools, tool_choice=tool_choice,
        temperature=0, max_tokens=400)
    [call] = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and answer.choices[0].message.content is None
    schema = {"Trip": Trip, "City": City}[call.function.name].model_json_schema()
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_streamed_forced_call_equals_the_whole_one(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 400,
            "tools": [{"type": "function", "function": {"name": "City", "parameters": City.model_json_schema()}}],
            "tool_choice": "required"}
    client = openai_client(server, [])
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason) == "tool_calls"
