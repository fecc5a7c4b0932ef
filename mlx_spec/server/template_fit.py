"""What agents send, made into what a chat template can render: tool schemas a template walks
key by key, and conversations for templates that insist on alternating roles.

Google's Gemma 4 templates do not dump a tool's JSON schema: they walk its properties and
write each as `name:{description:…,type:<|"|>STRING<|"|>}`, reading only `type`,
`description`, `enum`, `nullable`, `properties`, `required` and `items`. What agents send
(Claude Code's 25 tools, opencode's, Codex's: `tests/data/agents/`) also has `anyOf`,
`oneOf`, `const`, type lists (`["string", "null"]`), `$ref` into `$defs`, `additionalProperties`
and untyped fields; walked as sent, those come out as an empty type, a Python list's repr, or
`additionalProperties` written as if it were a property. `walked_tools` rewrites each schema
into the keys such a template reads, keeping its meaning where the keys can say it:

- `$ref` is replaced by the definition it names (`$defs` / `definitions`; a cycle stops as an
  object);
- a type list or an `anyOf`/`oneOf` whose other branches are `null` becomes that type with
  `nullable: true`; branches of one type merge (their enums and consts joined); branches of
  several types take the first's type, the others named in the description;
- `const` becomes a one-value `enum`; an untyped field is a string when its enum is, else it
  is described as taking any JSON value (typed "string", the loosest type the format has);
- an object always has `properties` (empty when it declares none), so its own keywords are
  never read as property names; every other keyword is dropped.

Only templates that walk schemas get them rewritten (`walks_schemas`); a template that
writes the schema with `tojson` shows it whole, as sent. The grammar of a strict call and
the parsing of calls always use the schema as sent.

`alternated` merges consecutive messages of one role (and moves later system messages into
the first) for templates that raise unless user and assistant alternate (Gemma 3's, Llama
2's): opencode sends system, user, user for a title. Tool calls and tool answers are never
merged.
"""

from __future__ import annotations

import copy
from typing import Optional

WALKED_KEYS = ("type", "description", "enum", "nullable", "properties", "required", "items")
JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object")
MAX_DEPTH = 16  # nested schemas followed; deeper ones are plain objects


def walks_schemas(template: str) -> bool:
    """Whether a chat template reads tool schemas key by key (Google's Gemma 4 templates)
    rather than writing them whole with `tojson`."""
    return "properties" in template and "tojson" not in template


def requires_alternation(template: str) -> bool:
    """Whether a chat template raises unless user and assistant turns alternate."""
    return "must alternate" in template


def walked_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    """OpenAI-shaped tools with each function's `parameters` in the keys a walking template
    reads (`walked_schema`)."""
    if not tools:
        return tools
    out = []
    for tool in tools:
        function = dict(tool["function"])
        if isinstance(function.get("parameters"), dict):
            parameters = function["parameters"]
            function["parameters"] = walked_schema(parameters, _definitions(parameters))
        out.append({**tool, "function": function})
    return out


def walked_schema(schema: dict, definitions: dict, depth: int = 0, seen: frozenset = frozenset()) -> dict:
    """One schema in `WALKED_KEYS` only (the module docstring says how each keyword maps)."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return {"type": "object", "properties": {}}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref in seen or ref.rsplit("/", 1)[-1] not in definitions:
            return _described({"type": "object", "properties": {}}, schema.get("description"))
        target = definitions[ref.rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return walked_schema(merged, definitions, depth + 1, seen | {ref})
    schema, notes = _one_type(schema, definitions, depth, seen)
    out: dict = {}
    kind = schema.get("type")
    if kind in JSON_TYPES:
        out["type"] = kind
    enum = schema.get("enum")
    if "const" in schema:
        enum = [schema["const"]]
    if isinstance(enum, list) and enum:
        out["enum"] = enum
        if "type" not in out and all(isinstance(v, str) for v in enum):
            out["type"] = "string"
    if "type" not in out:
        if isinstance(schema.get("properties"), dict):
            out["type"] = "object"
        elif "items" in schema:
            out["type"] = "array"
        else:
            out["type"] = "string"
            notes.append("any JSON value")
    if schema.get("nullable") is True:
        out["nullable"] = True
    if out["type"] == "object":
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        out["properties"] = {name: walked_schema(value, definitions, depth + 1, seen)
                             for name, value in properties.items()}
        required = schema.get("required")
        if isinstance(required, list) and required:
            out["required"] = [name for name in required if isinstance(name, str) and name in properties]
    elif out["type"] == "array" and isinstance(schema.get("items"), dict):
        out["items"] = walked_schema(schema["items"], definitions, depth + 1, seen)
    return _described(out, schema.get("description"), notes)


def _one_type(schema: dict, definitions: dict, depth: int, seen: frozenset) -> tuple[dict, list[str]]:
    """The schema with its type lists and anyOf/oneOf folded into one `type` (nullable
    where a branch is null), and notes for the description on what the fold lost."""
    schema, notes = dict(schema), []
    kinds = schema.get("type")
    if isinstance(kinds, list):
        named = [k for k in kinds if k != "null"]
        schema["type"] = named[0] if named else "string"
        if "null" in kinds:
            schema["nullable"] = True
        if len(named) > 1:
            notes.append("one of: " + ", ".join(map(str, named)))
    for key in ("anyOf", "oneOf"):
        branches = schema.pop(key, None)
        if not isinstance(branches, list):
            continue
        branches = [walked_schema(b, definitions, depth + 1, seen) if isinstance(b, dict) and "$ref" in b
                    else b for b in branches if isinstance(b, dict)]
        nulls = [b for b in branches if b.get("type") == "null" or b.get("const", 0) is None]
        branches = [b for b in branches if b not in nulls]
        if nulls:
            schema["nullable"] = True
        if not branches:
            continue
        first = {**branches[0], **{k: v for k, v in schema.items() if k in ("description", "nullable")}}
        kinds = [_kind(b) for b in branches]
        if all(k == kinds[0] for k in kinds):
            values = [v for b in branches for v in (b.get("enum") or ([b["const"]] if "const" in b else []))]
            if values and all("enum" in b or "const" in b for b in branches):
                first.pop("const", None)
                first["enum"] = list(dict.fromkeys(values))
        else:
            notes.append("one of: " + ", ".join(dict.fromkeys(k or "any" for k in kinds)))
        schema = {**{k: v for k, v in schema.items() if k not in ("type",)}, **first}
    return schema, notes


def _kind(schema: dict) -> Optional[str]:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None and "const" in schema:
        return {str: "string", bool: "boolean", int: "integer", float: "number"}.get(type(schema["const"]))
    return kind


def _definitions(schema: dict) -> dict:
    found = {}
    for key in ("definitions", "$defs"):
        if isinstance(schema.get(key), dict):
            found.update(schema[key])
    return found


def _described(schema: dict, description, notes: tuple | list = ()) -> dict:
    text = description if isinstance(description, str) else ""
    if notes:
        text = (text + " " if text else "") + "(" + "; ".join(notes) + ")"
    if text:
        schema["description"] = text
    return schema


def alternated(messages: list[dict]) -> list[dict]:
    """The conversation with user and assistant alternating, for templates that require it:
    later system messages joined to the first (a new first one if there is none), then
    consecutive user messages, and consecutive assistant messages without calls, joined
    (their texts separated by a blank line)."""
    systems = [m for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    out: list[dict] = []
    if systems:
        first = copy.copy(systems[0])
        for later in systems[1:]:
            first["content"] = _joined(first["content"], later["content"])
        out.append(first)
    for message in rest:
        previous = out[-1] if out else None
        if (previous is not None and previous["role"] == message["role"] in ("user", "assistant")
                and not previous.get("tool_calls") and not message.get("tool_calls")):
            out[-1] = {**previous, "content": _joined(previous["content"], message["content"])}
        else:
            out.append(message)
    return out


def _joined(a, b):
    """Two contents as one: texts joined by a blank line, or their parts in order."""
    if not a:
        return b
    if not b:
        return a
    if isinstance(a, str) and isinstance(b, str):
        return a + "\n\n" + b
    parts = lambda c: [{"type": "text", "text": c}] if isinstance(c, str) else list(c)  # noqa: E731
    return parts(a) + [{"type": "text", "text": "\n\n"}] + parts(b)
