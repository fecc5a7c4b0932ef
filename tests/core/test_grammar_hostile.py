"""Grammars that lied or failed late (issue 46, items 10 to 13): integer bounds llguidance
clamps, special-token text inside schemas and grammars, schemas no text satisfies, errors
that echoed megabytes, a grammar too large to compile. On the tiny model and its byte-level
tokenizer (whose added tokens are Gemma's control tokens, "<eos>", "<start_of_turn>", ...);
every finished value is validated with `jsonschema`, not with our code, and speculative
output is compared with plain constrained decoding."""

import json
import time

import httpx
import jsonschema
import pytest
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer

from cli_support import assert_usage_error, invoke, invoke_json
from mlx_spec.drafters import NgramDrafter
from mlx_spec.core.engine import Engine
from mlx_spec.errors import UsageError
from mlx_spec.core.grammar import compile_grammar
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.testing.tiny import EOS_ID, END_OF_TURN_ID, byte_tokenizer_json, tiny_gemma3
from scripted_model import InProcessServer, save_tokenizer
from server_support import anthropic_error, assert_openai_error

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache

EOS = (EOS_ID, END_OF_TURN_ID)
TOKENIZER = Tokenizer.from_str(json.dumps(byte_tokenizer_json()))
PROMPT = [2] + TOKENIZER.encode("A value: ", add_special_tokens=False).ids
CONTROL_IDS = {a["id"] for a in byte_tokenizer_json()["added_tokens"]}


@pytest.fixture(scope="module")
def target():
    return tiny_gemma3(seed=0)


def run(engine, kind, source, gamma, max_tokens=40):
    matcher = compile_grammar(TOKENIZER, kind, source, EOS).matcher(EOS)
    rounds = list(engine.rounds(PROMPT, SamplingParams(), gamma=gamma, max_tokens=max_tokens, constraint=matcher))
    return [t for r in rounds for t in r.tokens if t not in EOS], rounds[-1].finish_reason


# -- 11. special-token text is plain text -----------------------------------------------------

SPECIAL = [
    ("json_schema", {"const": "<eos>"}),
    ("json_schema", {"const": "<start_of_turn>"}),
    ("json_schema", {"enum": ["a<eos>b", "c"]}),
    ("json_schema", {"type": "object", "properties": {"<eos>": {"const": 1}}, "required": ["<eos>"],
                     "additionalProperties": False}),
    ("json_schema", {"type": "string", "pattern": "^x<end_of_turn>$"}),
    ("lark", 'start: "<eos>" "ok"'),
    ("regex", "<start_of_turn>user\\n(yes|no)<end_of_turn>"),
]


@pytest.mark.parametrize("kind,source", SPECIAL, ids=[json.dumps(s) for _, s in SPECIAL])
def test_special_token_text_is_generated_as_plain_text(target, kind, source):
    """The forced run ("<eos>" inside a const) was tokenized into the control token, which
    the grammar does not allow (a control token is not its text): "a draft path left the
    grammar" mid-generation. Now the value completes, as text, never a control token, and
    the speculative tokens are plain constrained decoding's."""
    tokens, finish = run(Engine(target, NgramDrafter()), kind, source, gamma=3)
    plain, plain_finish = run(Engine(target), kind, source, gamma=0)
    assert finish == "stop" and (tokens, finish) == (plain, plain_finish)
    assert not CONTROL_IDS & set(tokens)
    text = TOKENIZER.decode(tokens, skip_special_tokens=False)
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), source)
    elif kind == "lark":
        assert text == "<eos>ok"
    else:
        assert text in ("<start_of_turn>user\nyes<end_of_turn>", "<start_of_turn>user\nno<end_of_turn>")


# -- 10. bounds a grammar cannot enforce ------------------------------------------------------

@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 1e300, "maximum": 1e301},
    {"type": "object", "properties": {"n": {"type": ["integer", "null"], "maximum": -1e19}}},
    {"type": "array", "items": {"type": "integer", "exclusiveMinimum": 2**64}},
])
def test_an_integer_bound_outside_int64_is_refused(schema):
    """llguidance clamps integer bounds to int64: a minimum of 1e300 answered
    9223372036854775807 with finish "stop", a value that breaks the schema."""
    with pytest.raises(UsageError, match="outside what it can enforce") as refused:
        compile_grammar(TOKENIZER, "json_schema", schema, EOS)
    assert "\n" not in str(refused.value)


def test_bounds_inside_int64_still_compile_and_hold(target):
    schema = {"type": "integer", "minimum": 2**62, "maximum": 2**63 - 1}
    tokens, finish = run(Engine(target, NgramDrafter()), "json_schema", schema, gamma=3)
    if finish == "stop":
        jsonschema.validate(json.loads(TOKENIZER.decode(tokens)), schema)


# -- 12. unsatisfiable schemas, one-line errors -----------------------------------------------

UNSATISFIABLE = [
    ("json_schema", {"$ref": "#"}),
    ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ("json_schema", {"description": "x" * 100_000, "$ref": "#"}),
    ("lark", "start: a\na: a"),
    ("lark", "start: /[^\\s\\S]/"),
]


@pytest.mark.parametrize("kind,source", UNSATISFIABLE, ids=range(len(UNSATISFIABLE)))
def test_an_unsatisfiable_grammar_is_refused_when_compiled(kind, source):
    """These compiled, then failed at the first mask with a multi-line dump of the parser's
    state and the whole schema (8 MB in, an 8 MB error out)."""
    with pytest.raises(UsageError, match="unsatisfiable") as refused:
        compile_grammar(TOKENIZER, kind, source, EOS)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 400


def test_a_compile_error_in_a_large_grammar_does_not_echo_it():
    source = "start: " + " | ".join(f'"w{i}"' for i in range(5000)) + " | undefined_rule"
    with pytest.raises(UsageError) as refused:
        compile_grammar(TOKENIZER, "lark", source, EOS)
    assert "\n" not in str(refused.value) and len(str(refused.value)) <= 400


# -- 13. a grammar too large to compile -------------------------------------------------------

def test_a_huge_grammar_is_refused_at_once_on_one_line(models, tmp_path):
    """200,000 Lark alternatives: 60 s of CPU, then a Rust panic with an 84-frame backtrace
    as the "one-line" error. Now: refused by size before compiling."""
    grammar = tmp_path / "huge.lark"
    grammar.write_text("start: " + " | ".join(f'"a{i}"' for i in range(200_000)))
    began = time.monotonic()
    result = invoke(["generate", "Hi", *models, "--raw", "-n", "4", "--grammar", grammar])
    assert_usage_error(result, "too large")
    assert time.monotonic() - began < 30 and "panicked" not in result.stderr


def test_the_cli_generates_special_token_text(models, tmp_path):
    grammar = tmp_path / "eos.lark"
    grammar.write_text('start: "<eos>" "ok"')
    out = invoke_json(["generate", "Hi", *models, "--raw", "-n", "20", "--gamma", "3", "--grammar", grammar])
    assert out["finish_reason"] == "stop" and out["text"] == "<eos>ok"


# -- the server: output_config named as such, special text, 400s ------------------------------

TEMPLATE = ("{{ bos_token }}{%- for message in messages -%}"
            "{{ '<start_of_turn>' + message.role + '\\n' + message.content + '<end_of_turn>\\n' }}"
            "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")
ASK = [{"role": "user", "content": "A value?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, target):
    tokenizer = load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE),
                               eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    engine = Engine(target, NgramDrafter(), eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    served = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name="tiny", gamma="3")))
    yield served
    served.stop()


def _anthropic(server, schema):
    return httpx.post(server.base.removesuffix("/v1") + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 40, "messages": ASK,
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})


def test_anthropic_output_config_errors_name_output_config(server):
    """`hasattr(body, "response_format")` was always true: Anthropic's errors spoke of a
    field the request does not have."""
    message = anthropic_error(_anthropic(server, {"type": "integer", "minimum": 1e300}), 400,
                              "invalid_request_error")
    assert message.startswith("output_config.format: ") and "response_format" not in message
    message = anthropic_error(_anthropic(server, {"$ref": "#"}), 400, "invalid_request_error")
    assert message.startswith("output_config.format: ") and "unsatisfiable" in message


def test_anthropic_output_config_with_special_token_text(server):
    schema = {"const": "<eos>"}
    response = _anthropic(server, schema)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["stop_reason"] == "end_turn"
    jsonschema.validate(json.loads(body["content"][0]["text"]), schema)


@pytest.mark.parametrize("schema,fragment", [
    ({"type": "integer", "minimum": 1e300, "maximum": 1e301}, "outside what it can enforce"),
    ({"$ref": "#"}, "unsatisfiable"),
    ({"const": "x" * 600_000}, "too large"),  # over the bound: refused before compiling
])
def test_openai_response_format_refusals_are_one_line_400s(server, schema, fragment):
    response = httpx.post(server.base + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": ASK, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}})
    error = assert_openai_error(response, 400, "response_format", fragment)
    assert len(error["message"]) < 400


# -- 8. compiling never holds the parsing thread; its backlog is bounded -----------------------

def test_slow_compiles_neither_stall_other_requests_nor_queue_without_bound(tmp_path_factory, target, monkeypatch):
    """Grammars compiled on the one parsing thread, with no bound on the backlog: six 8 MB
    const schemas (4 s each) held an unrelated 1-token completion for 23.8 s. Here each
    compile is made to take 2 s (a schema under the size bound can still cost seconds):
    a plain completion sent while three wait is answered at once, and compiles beyond the
    queue's room get 503 with Retry-After."""
    import threading

    import mlx_spec.server.serving as serving_module

    compile_now = serving_module.compile_grammar

    def slow(*args, **kwargs):
        time.sleep(2)
        return compile_now(*args, **kwargs)

    monkeypatch.setattr(serving_module, "compile_grammar", slow)
    tokenizer = load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok8"), TEMPLATE),
                               eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    engine = Engine(target, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    served = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name="tiny", gamma="0",
                                                                         queue_size=3)))
    statuses = []

    def structured():
        response = httpx.post(served.base + "/completions", timeout=60, json={
            "model": "tiny", "prompt": "A value:", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {"const": "x"}}}})
        statuses.append((response.status_code, response.headers.get("retry-after")))

    try:
        senders = [threading.Thread(target=structured) for _ in range(5)]
        for sender in senders:
            sender.start()
            time.sleep(0.05)
        began = time.monotonic()
        plain = httpx.post(served.base + "/completions", timeout=60,
                           json={"model": "tiny", "prompt": "Hello", "max_tokens": 1})
        waited = time.monotonic() - began
        for sender in senders:
            sender.join(60)
    finally:
        served.stop()
    assert plain.status_code == 200, plain.text
    assert waited < 1.5, f"an unrelated request waited {waited:.1f} s behind grammar compiles"
    assert sorted(s for s, _ in statuses).count(200) >= 1
    assert any(s == 503 and retry for s, retry in statuses), statuses


# -- 10. no schema-violating success through the server ---------------------------------------

def test_every_finished_answer_through_the_server_validates(server):
    """The 34 schemas of tests/data/schemas.json through `response_format`, greedy with
    n-gram drafts and forced runs: each answer that says `stop` must validate (jsonschema),
    and most must finish."""
    from pathlib import Path

    schemas = json.loads((Path(__file__).parents[1] / "data" / "schemas.json").read_text())
    finished = 0
    for i, schema in enumerate(schemas):
        response = httpx.post(server.base + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": ASK, "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}})
        assert response.status_code == 200, (i, response.text)
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            finished += 1
    assert finished >= 0.8 * len(schemas)
