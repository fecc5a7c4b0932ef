"""JSON schemas as the libraries send them (issue 42, item 5): a Pydantic model's schema
(instructor's `JSON_SCHEMA` mode, pydantic-ai's `NativeOutput`) says nothing of keys it does
not list, and compiled as written it let a model add keys, and repeat an added one. Objects
that list their properties are closed, as vLLM (xgrammar's strict mode) and llama.cpp read
them; what a schema opens itself stays open. Checked on llguidance's own matcher over a
byte-level tokenizer: which texts the grammar lets through."""

import json

import pytest
from mlx_lm.utils import load_tokenizer
from pydantic import BaseModel

from mlx_spec.core.grammar import closed_objects, compile_grammar
from scripted_model import EOS_ID, save_tokenizer


class Address(BaseModel):
    street: str
    zip_code: str


class Person(BaseModel):
    name: str
    address: Address


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("bytes")))


def allowed(tokenizer, schema: dict, text: str) -> bool:
    matcher = compile_grammar(tokenizer, "json_schema", schema, [EOS_ID]).matcher([EOS_ID])
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return matcher.valid_prefix(ids) == len(ids)


def test_a_pydantic_schema_admits_its_own_keys_once_each_and_no_others(tokenizer):
    schema = Person.model_json_schema()  # nested model under $defs, no additionalProperties
    assert "additionalProperties" not in json.dumps(schema)
    good = '{"name": "Ada", "address": {"street": "Main", "zip_code": "1"}}'
    assert allowed(tokenizer, schema, good)
    for bad in ('{"name": "Ada", "age": 3',  # an extra key
                '{"name": "Ada", "address": {"street": "Main", "zip_code": "1", "zip_code2"',
                '{"name": "Ada", "address": {"street": "Main", "zip_code": "1", "zip_code": "2"'):
        assert not allowed(tokenizer, schema, bad), bad


def test_what_a_schema_opens_stays_open(tokenizer):
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    assert allowed(tokenizer, open_schema, '{"a": 1, "b": 2}')
    typed = {"type": "object", "properties": {"a": {"type": "integer"}},
             "additionalProperties": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    assert allowed(tokenizer, typed, '{"a": 1, "b": {"x": 2}}')
    assert not allowed(tokenizer, typed, '{"a": 1, "b": {"x": 2, "y"')  # the value schema is closed
    assert allowed(tokenizer, {"type": "object"}, '{"b": 2}')  # no properties listed: any object
    assert closed_objects({"type": "object", "properties": {}, "patternProperties": {"^x": {}}}) == {
        "type": "object", "properties": {}, "patternProperties": {"^x": {}}}
