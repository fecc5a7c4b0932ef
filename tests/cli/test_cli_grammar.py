"""generate / chat with --json-schema, --regex and --grammar (issue 34) on the tiny models."""

import json

import jsonschema
import pytest
from cli_support import assert_usage_error, invoke, invoke_json

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    "kind": {"enum": ["home", "work"]}}, "required": ["city", "zip", "kind"], "additionalProperties": False}


@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
def test_generate_json_schema_inline(models, drafter):
    out = invoke_json(["generate", "An address:", *models, "--raw", "-n", "80", "--gamma", "3",
                       "--drafter", drafter, "--json-schema", json.dumps(SCHEMA)])
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["stats"]["grammar_forced"] > 5 and 0 < out["stats"]["grammar_forced_share"] < 1


def test_generate_json_schema_file_regex_and_lark(models, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    by_file = invoke_json(["generate", "An address:", *models, "--raw", "-n", "80", "--json-schema", schema])
    inline = invoke_json(["generate", "An address:", *models, "--raw", "-n", "80", "--json-schema", json.dumps(SCHEMA)])
    assert by_file["text"] == inline["text"]
    regex = invoke_json(["generate", "A code:", *models, "--raw", "-n", "20", "--regex", "[A-Z]{2}-[0-9]{3}"])
    assert regex["finish_reason"] == "stop" and len(regex["text"]) == 6 and regex["text"][2] == "-"
    lark = tmp_path / "yes_no.lark"
    lark.write_text('start: answer "!"\nanswer: "yes" | "no"\n')
    answer = invoke_json(["generate", "Well?", *models, "--raw", "-n", "20", "--grammar", lark])
    assert answer["text"] in ("yes!", "no!")


def test_the_summary_line_counts_grammar_forced_tokens(models):
    result = invoke(["generate", "An address:", *models, "--raw", "-n", "80", "--json-schema", json.dumps(SCHEMA)])
    assert result.exit_code == 0 and "grammar-forced " in result.stderr.splitlines()[-1]
    jsonschema.validate(json.loads(result.stdout), SCHEMA)


def test_a_value_cut_by_max_tokens_says_length(models):
    out = invoke_json(["generate", "An address:", *models, "--raw", "-n", "6", "--json-schema", json.dumps(SCHEMA)])
    assert out["finish_reason"] == "length" and out["generated_tokens"] == 6


@pytest.mark.parametrize("args,fragments", [
    (["--json-schema", '{"type": "object", "dependentSchemas": {"a": {}}}'], ["--json-schema", "dependentSchemas"]),
    (["--json-schema", "{oops"], ["--json-schema", "not valid JSON"]),
    (["--regex", "[a-"], ["--regex", "unclosed character class"]),
    (["--regex", "a", "--json-schema", "{}"], ["--json-schema", "--regex"]),
    (["--regex", "a", "--think"], ["--regex", "--think"]),
])
def test_a_bad_grammar_is_a_one_line_usage_error(models, args, fragments):
    assert_usage_error(invoke(["generate", "Hi", *models, "--raw", "-n", "4", *args]), *fragments)


def test_chat_refuses_a_grammar_with_thinking(models):
    assert_usage_error(invoke(["chat", *models, "--think", "--json-schema", "{}"], input="Hi\n"),
                       "--json-schema", "--think")


def test_chat_answers_follow_the_schema(models):
    result = invoke(["chat", *models, "-n", "80", "--gamma", "2", "--json-schema", json.dumps(SCHEMA)],
                    input="An address?\nAnother?\n")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    values = [json.loads(line.removeprefix(">>> ")) for line in result.stdout.splitlines()
              if line.startswith(">>> {")]
    assert len(values) == 2
    for value in values:
        jsonschema.validate(value, SCHEMA)
