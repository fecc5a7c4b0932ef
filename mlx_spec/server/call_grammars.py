"""Grammars for a forced tool call in the model's own call syntax (llguidance's Lark dialect):
the text after the call's start marker is a call to one of the offered functions whose
arguments follow that function's `parameters` schema, so the answer parses into a call that
validates. Two syntaxes are known:

- JSON calls (mlx-lm's `json_tools`: `{"name": ..., "arguments": {...}}`): the schema goes to
  llguidance's own JSON compiler (`%json`).
- Gemma 4's, as Google's chat template writes a call (`format_argument`) and mlx-lm's `gemma4`
  parser reads it back: `call:NAME{key:value,...}<tool_call|>`. Strings are raw text between
  `<|"|>` delimiters (no escapes, so a string cannot hold the delimiter's text), keys are bare
  words (any other key is a delimited string, which the parser also reads), numbers, `true`,
  `false` and `null` as JSON writes them, arrays `[a,b]`, objects `{k:v}`, and no spaces. An
  object's keys come in the template's order (jinja's `dictsort`: by the lower-cased key).
  `GemmaValues` compiles a JSON schema into rules for that syntax: types, `enum`, `const`,
  `anyOf` / `oneOf` (as a union), a one-part `allOf`, `$ref` into the schema, `properties` /
  `required` / `additionalProperties`, `items` / `prefixItems` / `minItems` / `maxItems`,
  `minLength` / `maxLength` / `pattern`, and every number keyword (a number's text is
  JSON's, so numbers go to `%json`). `format` and `uniqueItems` are not enforced; other
  keywords (`not`, `if`, `patternProperties`, ...) are a `CallGrammarError`.
"""

from __future__ import annotations

import json
import re
from typing import Collection

from mlx_spec.core.grammar import JSON_OPTIONS, closed_objects

QUOTE = '<|"|>'  # Gemma 4's string delimiter (one special token in its vocabulary)
BARE_KEY = re.compile(r"[A-Za-z0-9_]+")  # keys mlx-lm's gemma4 parser quotes itself (`\w+`, ASCII here)
CALL_NAME = re.compile(r"[\w-]+")  # the names mlx-lm's gemma4 parser reads after "call:"
# Keywords this compiler enforces, or that only describe (titles, defaults, examples).
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "format", "uniqueItems", "contentMediaType", "contentEncoding",
                "$defs", "definitions", "nullable", "strict", "x-guidance"}
_NUMBER_KEYWORDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_KNOWN = _ANNOTATIONS | _NUMBER_KEYWORDS | {
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "required",
    "additionalProperties", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern",
    "minProperties", "maxProperties"}


class CallGrammarError(ValueError):
    """A schema this call syntax's grammar cannot express (the message names the keyword)."""


def json_call_grammar(tools: list[dict]) -> str:
    """One JSON call (json_tools' shape) to one of `tools`, its arguments their `parameters`
    schema (%json)."""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        schema = {**closed_objects(tool["function"].get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        head = json.dumps('{"name": ' + json.dumps(tool["function"]["name"]) + ', "arguments": ')
        calls.append(f"{head} args{i} \"}}\"")
        rules.append(f"args{i}: %json {json.dumps(schema)}")
    return "start: " + " | ".join(calls) + "\n" + "\n".join(rules) + "\n"


def gemma4_call_grammar(tools: list[dict], end: str, token_ids: dict[str, int],
                        free_arguments: Collection[str] = ()) -> str:
    """One Gemma 4 call to one of `tools`, ended by the `end` marker, its arguments their
    `parameters` schema (any object of arguments for the functions named in `free_arguments`). `token_ids`: the
    ids of the marker texts that are single tokens (the delimiter, the end marker), which the
    grammar names as tokens; a marker that is not one is written as its text.

    Raises:
        CallGrammarError: a function name the parser cannot read, or a schema keyword the
            syntax cannot express (naming the tool and keyword).
    """
    calls, rules = [], {}
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not CALL_NAME.fullmatch(name):
            raise CallGrammarError(f"tools[{i}].function.name: {name!r} cannot be written in this model's "
                                   "call format (letters, digits, '_' and '-' only)")
        schema = {"type": "object"} if name in free_arguments else tool["function"].get("parameters") or {
            "type": "object", "properties": {}}
        values = GemmaValues(closed_objects(schema), _token(QUOTE, token_ids), prefix=f"t{i}_")
        try:
            arguments = values.value(values.root)
        except CallGrammarError as error:
            raise CallGrammarError(f"tools[{i}].function.parameters: {error}") from None
        if "object" not in values.types_of(values.root):
            raise CallGrammarError(f"tools[{i}].function.parameters: must be an object schema")
        calls.append(f'"call:{name}" {arguments} {_token(end, token_ids)}')
        rules.update(values.rules)
    body = "\n".join(f"{rule}: {expansion}" for rule, expansion in rules.items())
    return "start: " + " | ".join(calls) + "\n" + body + "\n" + _TERMINALS


# Text between delimiters: anything but the delimiter's own text (a special token is never text).
# A number with no bounds has at most a double's digits and a finite exponent (1e999 reads
# back as Infinity, which is no JSON); a free key is a word of at most 64 characters.
_TERMINALS = (
    'TEXT: /(?s:.*)/ & ~/(?s:.*<\\|"\\|>.*)/\n'
    "BARE: /[A-Za-z0-9_]{1,64}/\n"
    "NUMBER: /-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?/\n")


def _token(text: str, token_ids: dict[str, int]) -> str:
    return f"<[{token_ids[text]}]>" if text in token_ids else json.dumps(text)


class GemmaValues:
    """Lark rules for values of a JSON schema in Gemma 4's argument syntax (module docstring).
    `value(schema)` names the rule for one schema, made once per distinct schema (so `$ref`
    cycles are rules that refer to themselves)."""

    def __init__(self, root, quote: str, prefix: str = ""):
        self.root, self.quote, self.prefix = root, quote, prefix
        self.rules: dict[str, str] = {}
        self._named: dict[str, str] = {}
        self._terminals = 0

    def value(self, schema) -> str:
        key = json.dumps(schema, sort_keys=True)
        if key not in self._named:
            name = self._named[key] = f"{self.prefix}v{len(self._named)}"
            self.rules[name] = self._expansion(schema)
        return self._named[key]

    def types_of(self, schema) -> set:
        """The JSON types a schema admits, as far as its own keywords tell."""
        if schema is True or schema == {}:
            return {"object", "array", "string", "number", "integer", "boolean", "null"}
        schema = self._resolved(schema)
        kinds = schema.get("type")
        if isinstance(kinds, str):
            return {kinds}
        if isinstance(kinds, list):
            return set(kinds)
        union = schema.get("anyOf") or schema.get("oneOf") or schema.get("allOf")
        if union:
            return set().union(*(self.types_of(s) for s in union))
        return {"object"} if "properties" in schema else self.types_of(True)

    # -- one schema -------------------------------------------------------------------------

    def _expansion(self, schema) -> str:
        if schema is True or schema == {}:
            return self._any()
        if schema is False:
            raise CallGrammarError("a false schema admits no value")
        if not isinstance(schema, dict):
            raise CallGrammarError("a schema must be an object")
        unknown = sorted(set(schema) - _KNOWN)
        if unknown:
            raise CallGrammarError(f"{unknown[0]!r} is not supported in this model's call format")
        if "$ref" in schema:
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
            target = self._pointer(schema["$ref"])
            return self.value({**target, **rest} if rest and isinstance(target, dict) else target)
        if "const" in schema:
            return self._literal(schema["const"])
        if "enum" in schema:
            if not schema["enum"]:
                raise CallGrammarError("an empty enum admits no value")
            return " | ".join(self._literal(v) for v in schema["enum"])
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "allOf")}
        if "allOf" in schema:
            parts = schema["allOf"]
            if len(parts) != 1:
                raise CallGrammarError("'allOf' of more than one schema is not supported in this model's call format")
            return self.value(_merged(rest, self._resolved(parts[0])))
        union = schema.get("anyOf") or schema.get("oneOf")
        if union is not None:
            if not union:
                raise CallGrammarError("an empty anyOf admits no value")
            return " | ".join(self.value(_merged(rest, self._resolved(s))) for s in union)
        kinds = schema.get("type")
        if isinstance(kinds, list):
            return " | ".join(self.value({**schema, "type": kind}) for kind in kinds)
        if kinds is None:
            kinds = ("object" if "properties" in schema or "additionalProperties" in schema else
                     "array" if "items" in schema or "prefixItems" in schema else
                     "string" if {"pattern", "minLength", "maxLength"} & set(schema) else None)
            if kinds is None:
                return self._any()
        return self._typed(kinds, schema)

    def _typed(self, kind: str, schema: dict) -> str:
        if kind == "string":
            return f"{self.quote} {self._text(schema)} {self.quote}"
        if kind in ("integer", "number"):
            numeric = {k: v for k, v in schema.items() if k in _NUMBER_KEYWORDS}
            if kind == "number" and not numeric:  # finite: 1e999 reads back as Infinity, no JSON
                return "NUMBER"
            return f"%json {json.dumps({'type': kind, **numeric})}"
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(schema)
        if kind == "object":
            return self._object(schema)
        raise CallGrammarError(f"type {kind!r} is not a JSON type")

    def _text(self, schema: dict) -> str:
        """A terminal for a string's raw text: its pattern and length, never the delimiter."""
        if not {"pattern", "minLength", "maxLength"} & set(schema):
            return "TEXT"
        parts = ['/(?s:.*)/', '~/(?s:.*<\\|"\\|>.*)/']
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low or high is not None:
            parts.append(f"/(?s:.{{{low},{'' if high is None else high}}})/")
        if "pattern" in schema:  # JSON Schema's patterns search: unanchored ends match anything
            pattern = schema["pattern"]
            head = "" if pattern.startswith("^") else "(?s:.*)"
            tail = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
            core = pattern.removeprefix("^").removesuffix("$") if tail == "" else pattern.removeprefix("^")
            parts.append("/" + head + "(?:" + core.replace("/", "\\/") + ")" + tail + "/")
        self._terminals += 1
        name = f"{self.prefix.upper()}TEXT{self._terminals}"
        self.rules[name] = " & ".join(parts)
        return name

    def _array(self, schema: dict) -> str:
        prefix = [self.value(s) for s in schema.get("prefixItems", [])]
        items = schema.get("items", True)
        rest = None if items is False else self.value(items)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high is not None and high < len(prefix):
            raise CallGrammarError("'maxItems' below the number of 'prefixItems' is not supported")
        if prefix:  # every prefix item, then what `items` allows
            seq = ' "," '.join(prefix)
            more = max(0, low - len(prefix))
            if rest is not None and (high is None or high > len(prefix)):
                extra = "" if high is None else str(high - len(prefix) - more)
                seq += f' ("," {rest}){{{more},{extra}}}'
            elif more:
                raise CallGrammarError("'minItems' beyond 'prefixItems' with 'items' false admits no value")
            return f'"[" {seq} "]"'
        if rest is None or high == 0:
            if low:
                raise CallGrammarError("'minItems' with no items allowed admits no value")
            return '"[]"'
        tail = f'("," {rest}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
        filled = f'"[" {rest} {tail} "]"'
        return filled if low else f'"[]" | {filled}'

    def _object(self, schema: dict) -> str:
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        missing = sorted(required - set(properties))
        additional = schema.get("additionalProperties", True)
        if missing:
            raise CallGrammarError(f"required key {missing[0]!r} is not among the properties")
        for name in properties:
            if QUOTE in name:
                raise CallGrammarError(f"the key {name!r} holds the string delimiter {QUOTE}")
        order = sorted(properties, key=str.lower)  # jinja's dictsort, as the template writes arguments
        low, high = schema.get("minProperties", 0), schema.get("maxProperties")
        if properties and (low or high is not None):
            raise CallGrammarError("'minProperties' / 'maxProperties' beside 'properties' is not supported "
                                   "in this model's call format")
        members = [(f"{self._key(name)} \":\" {self.value(properties[name])}", name in required) for name in order]
        if additional is not False and not properties and (low or high is not None):  # a map of counted keys
            member = f"{self._free_key([])} \":\" {self.value(additional)}"
            if high == 0:
                return '"{}"'
            filled = f'"{{" {member} ("," {member}){{{max(low - 1, 0)},{"" if high is None else high - 1}}} "}}"'
            return filled if low else f'"{{}}" | {filled}'
        if additional is not False:  # further keys, any but the listed ones, each a value of `additional`
            members.append((f"{self._free_key(order)} \":\" {self.value(additional)}", "many"))
        if not members:
            return '"{}"'
        return '"{" ' + self._members(members) + ' "}"'

    def _members(self, members: list[tuple[str, object]]) -> str:
        """Members in order, each once (required or not) or, the last, any number of times
        ("many"), commas between those written. From the end: `rest_i` is what may follow
        once something is written (each member after a comma), `first_i` what may come when
        nothing is yet."""
        base = f"{self.prefix}m{len(self.rules)}_"
        rest = first = None  # the rules for the members after i; None: there are none
        for i in reversed(range(len(members))):
            member, need = members[i]
            then = f" {rest}" if rest else ""
            if need == "many":
                after, alone = f'("," {member})*', f'({member} ("," {member})*)?'
            elif need:
                after, alone = f'"," {member}{then}', f"{member}{then}"
            else:
                after = f'("," {member})?{then}'
                alone = f"{member}{then} | {first}" if first else f"({member}{then})?"
            rest, first = f"{base}rest{i}", f"{base}first{i}"
            self.rules[rest], self.rules[first] = after, alone
        return first

    def _key(self, name: str) -> str:
        if BARE_KEY.fullmatch(name):
            return json.dumps(name)
        return f"{self.quote} {json.dumps(name)} {self.quote}"

    def _free_key(self, listed: list[str]) -> str:
        """A key that is none of `listed`: a bare word, or delimited text."""
        self._terminals += 1
        name = f"{self.prefix.upper()}KEY{self._terminals}"
        bare = [re.escape(k) for k in listed if BARE_KEY.fullmatch(k)]
        self.rules[name] = "BARE" if not bare else f"/[A-Za-z0-9_]+/ & ~/({'|'.join(bare)})/"
        quoted = [re.escape(k) for k in listed if not BARE_KEY.fullmatch(k)]
        text = "TEXT" if not quoted else self._named_terminal(f'/(?s:.*)/ & ~/(?s:.*<\\|"\\|>.*)/ & ~/({"|".join(quoted)})/')
        return f"({name} | {self.quote} {text} {self.quote})"

    def _named_terminal(self, expansion: str) -> str:
        self._terminals += 1
        name = f"{self.prefix.upper()}T{self._terminals}"
        self.rules[name] = expansion
        return name

    def _literal(self, value) -> str:
        """A value's text as the template writes it (`format_argument`), as Lark items."""
        if isinstance(value, str):
            if QUOTE in value:
                raise CallGrammarError(f"the value {value!r} holds the string delimiter {QUOTE}")
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
            return json.dumps(json.dumps(value))  # the JSON text, as a Lark string
        if isinstance(value, list):
            return '"[" ' + ' "," '.join(self._literal(v) for v in value) + ' "]"' if value else '"[]"'
        if isinstance(value, dict):
            items = [f'{self._key(k)} ":" {self._literal(value[k])}' for k in sorted(value, key=str.lower)]
            return '"{" ' + ' "," '.join(items) + ' "}"' if items else '"{}"'
        raise CallGrammarError(f"the value {value!r} is not JSON")

    def _any(self) -> str:
        """Any value (a schema that says nothing)."""
        name = f"{self.prefix}any"
        if name not in self.rules:
            self.rules[name] = ""  # reserved first: the expansion refers to itself
            member = f"{self.prefix}anymember"
            self.rules[member] = f'(BARE | {self.quote} TEXT {self.quote}) ":" {name}'
            self.rules[name] = (f'{self.quote} TEXT {self.quote} | NUMBER | "true" | "false" | "null"'
                                f' | "[" ({name} ("," {name})*)? "]" | "{{" ({member} ("," {member})*)? "}}"')
        return name

    def _resolved(self, schema):
        while isinstance(schema, dict) and "$ref" in schema and len(schema) == 1:
            schema = self._pointer(schema["$ref"])
        return schema

    def _pointer(self, ref: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise CallGrammarError(f"'$ref' {ref!r} is not within the schema")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise CallGrammarError(f"'$ref' {ref!r} points nowhere in the schema")
            node = node[part]
        return node


def _merged(outer: dict, inner) -> object:
    """A union member or `allOf` part with the constraints written beside the union (`type`
    beside `anyOf`, say); where both say something, the part's own keyword is kept."""
    if not isinstance(inner, dict):
        return inner
    outer = {k: v for k, v in outer.items() if k not in _ANNOTATIONS}
    return {**outer, **inner}

