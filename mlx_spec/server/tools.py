"""Tool calling: tools rendered through the model's own chat template, calls parsed from its
output by mlx-lm's tool parsers (`mlx_lm/tool_parsers/`), OpenAI's and Anthropic's shapes
built from what they return.

mlx-lm's tokenizer names the model's call syntax (`tool_call_start` / `tool_call_end`
markers and a `tool_parser`), inferred from the chat template. A template with none (Gemma
3's) cannot take tools, and a request that sends them is refused, as mlx-lm's server and
Ollama refuse them for such models, but for a forced call: its answer is the call's JSON,
by grammar (`BARE_JSON_CALLS`, as vLLM answers a forced call whatever the template). `tool_choice` "required" or a named function is kept by
ending the prompt with the start marker, so the model's first words are a call (a named
function is the only tool the template shows), and the call itself follows a grammar in the
model's own call syntax (`call_grammars`: JSON calls, mlx-lm's `json_tools`, and Gemma 4's
`call:NAME{...}<tool_call|>`): one of the offered functions, its arguments following its
`parameters` schema, strict or not (as vLLM constrains a forced call). Where the schema has
a keyword Gemma's syntax cannot express, a non-strict call is still a call to the function,
its arguments any object; a strict one is refused. `strict` needs a forced call and one of
those syntaxes. Whatever fails to parse, names a function that was not offered, or has
arguments with no strict JSON form (NaN, a set), is the model's text: it is returned as
content, never as an error.

A tool's answer reaches the template as Hugging Face's `tool` turn, except for templates that
read it from the model's own turn (Gemma 4's `message.tool_responses`): `native_tool_turns`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Union

from mlx_spec.apps.thinking import partial_suffix
from mlx_spec.server.api_error import ApiError
from mlx_spec.server.call_grammars import QUOTE, CallGrammarError, gemma4_call_grammar, json_call_grammar
from mlx_spec.server.body_bounds import parse_json
from mlx_spec.server.openai_requests import ChatRequest, Message


@dataclass(frozen=True)
class ToolSyntax:
    """How the model writes a call: start marker, end marker, and mlx-lm's parser."""

    start: str
    end: str
    parse: Callable  # (text between the markers, tools) -> {"name", "arguments"} or a list
    # What a forced call's grammar is written in (`call_grammars`): "json", "gemma4", or None
    # for a syntax it does not know (the call is forced by the start marker alone).
    grammar_format: Optional[str] = None
    token_ids: tuple = ()  # (text, id) of the marker texts that are single tokens


def _bare_json_call(text: str, tools=None):
    return json.loads(text)


# A forced call on a model whose template has no call format (Gemma 3's): no markers, the
# whole answer is the call as JSON calls write it (`{"name": ..., "arguments": {...}}`), by
# the grammar. Such a template does not show the tools: the grammar alone spells the call.
BARE_JSON_CALLS = ToolSyntax("", "", _bare_json_call, "json")


def tool_syntax(tokenizer) -> Optional[ToolSyntax]:
    """The tokenizer's tool-call syntax, or None when its template has none."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    module = getattr(tokenizer.tool_parser, "__module__", "")
    grammar_format = ("json" if module.endswith("json_tools") else
                      "gemma4" if module.endswith(".gemma4") else None)
    token_ids = []
    for text in (tokenizer.tool_call_end, QUOTE):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            token_ids.append((text, ids[0]))
    return ToolSyntax(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser,
                      grammar_format, tuple(token_ids))


@dataclass
class ToolPlan:
    """What a request's tools make of the prompt and the answer.

    Attributes:
        tools: tool definitions (OpenAI's shape) for the chat template, or None.
        forced: the prompt ends with the start marker (tool_choice required / named).
        syntax: how calls are parsed from the answer; None: the answer is all text.
        names: the functions the model may call.
        single: one call per answer (parallel_tool_calls false); later calls are dropped.
        grammar: the forced call's grammar (a Lark text, `forced_grammar`), or None.
        fallback: where no forced tool is strict, the grammar of a call with any arguments,
            taken if llguidance cannot compile `grammar` (a schema feature it lacks).
    """

    tools: Optional[list[dict]] = None
    forced: bool = False
    syntax: Optional[ToolSyntax] = None
    names: frozenset = frozenset()
    single: bool = False
    grammar: Optional[str] = None
    fallback: Optional[str] = None


def plan_tools(tools: Optional[list[dict]], choice, syntax: Optional[ToolSyntax],
               param: str = "tools", single: bool = False) -> ToolPlan:
    """A `ToolPlan` from OpenAI-shaped `tools` and `tool_choice` ("none", "auto",
    "required", or the name of one function); refuses tools the model cannot call. A forced
    call follows its grammar (`forced_grammar`)."""
    forced = choice not in (None, "auto", "none")
    if forced and syntax is None:  # no call format: the answer is the call's JSON (`BARE_JSON_CALLS`)
        syntax = BARE_JSON_CALLS
    for i, tool in enumerate(tools or []):
        if tool["function"].get("strict") and not (forced and syntax is not None and syntax.grammar_format):
            why = ("needs tool_choice 'required' or a named function (the call the answer must be)"
                   if not forced else "needs a tool-call format a grammar can follow (JSON calls or Gemma 4's), "
                                      "and this model's template has another")
            raise ApiError(400, f"{param}[{i}].function.strict: a strict schema {why}",
                           param=f"{param}[{i}].function.strict", code="unsupported_parameter")
    if not tools and choice not in (None, "auto", "none"):
        raise ApiError(400, "tool_choice: forcing a tool call needs tools, and the request has none",
                       param="tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    if syntax is None:
        raise ApiError(400, f"{param}: this model's chat template has no tool-call format, so it "
                            "cannot call tools", param=param, code="unsupported_parameter")
    forced = choice not in (None, "auto")
    indices = list(range(len(tools)))  # each tool's place in the request, for errors
    if forced and choice != "required":
        indices = [i for i in indices if tools[i]["function"]["name"] == choice]
        if not indices:
            raise ApiError(400, f"tool_choice: no tool is named {choice!r}", param="tool_choice")
    grammar = forced_grammar(tools, indices, syntax, param) if forced else None
    tools = [tools[i] for i in indices]
    fallback = None
    if grammar is not None and not any(t["function"].get("strict") for t in tools):
        free = [{**t, "function": {**t["function"], "parameters": {"type": "object"}}} for t in tools]
        fallback = forced_grammar(free, list(range(len(free))), syntax, param)
    return ToolPlan(tools, forced, syntax, frozenset(t["function"]["name"] for t in tools), single, grammar,
                    fallback)


def forced_grammar(tools: list[dict], indices: list[int], syntax: ToolSyntax, param: str) -> Optional[str]:
    """The Lark grammar of a forced call to one of `tools[i]` for i in `indices` in the
    model's call syntax, or None for a syntax `call_grammars` does not know. A schema Gemma
    4's syntax cannot express is refused for a strict tool (a 400 naming `param[i]` and the
    keyword) and leaves a non-strict tool's arguments free."""
    chosen = [tools[i] for i in indices]
    if syntax.grammar_format == "json":
        return json_call_grammar(chosen)
    if syntax.grammar_format != "gemma4":
        return None
    token_ids = dict(syntax.token_ids)
    free = []
    for i in indices:
        try:
            gemma4_call_grammar([tools[i]], syntax.end, token_ids)
        except CallGrammarError as error:
            where, why = str(error).split(": ", 1)
            at = f"{param}[{i}]{where.removeprefix('tools[0]')}"
            if tools[i]["function"].get("strict") or where.endswith(".name"):
                raise ApiError(400, f"{at}: {why}", param=at, code="unsupported_parameter") from None
            free.append(tools[i]["function"]["name"])
    return gemma4_call_grammar(chosen, syntax.end, token_ids, free_arguments=free)


def openai_plan(body: ChatRequest, syntax: Optional[ToolSyntax]) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.function.name
    return plan_tools(tools, choice, syntax, single=body.parallel_tool_calls is False)


def template_messages(messages: list[Message], syntax: Optional[ToolSyntax]) -> list[dict]:
    """OpenAI messages as chat templates take them (Hugging Face's convention): an
    assistant's calls with their arguments as objects, a tool's answer with the name of the
    function it answers. As OpenAI's API, a tool message must answer a call of the
    assistant message before it (tool messages between); calls and results are history the
    template shows even without `tools` (OpenAI takes them so too), but a template with no
    tool-call format (`syntax` None) cannot show them: refused."""
    called: dict[str, str] = {}  # call id -> function name
    answerable: set[str] = set()  # the latest assistant's call ids, while tool messages follow
    out = []
    for i, message in enumerate(messages):
        turn = message.as_template_message(f"messages[{i}].content")
        if (message.tool_calls or message.role == "tool") and syntax is None:
            field = "tool_calls" if message.tool_calls else "role"
            raise ApiError(400, f"messages[{i}].{field}: this model's chat template has no tool-call "
                                "format, so it cannot show tool calls or results",
                           param=f"messages[{i}].{field}", code="unsupported_parameter")
        if message.role != "tool":
            answerable = {call.id for call in message.tool_calls or []}
        if message.tool_calls:
            turn["tool_calls"] = []
            for j, call in enumerate(message.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                turn["tool_calls"].append(template_call(call.id, call.function.name,
                                                        _arguments(call.function.arguments, where)))
                called[call.id] = call.function.name
        if message.role == "tool":
            if message.tool_call_id is None:
                raise ApiError(400, f"messages[{i}].tool_call_id: a tool message needs the id of "
                                    "the call it answers", param=f"messages[{i}].tool_call_id")
            if not answerable:
                raise ApiError(400, f"messages[{i}]: a message with role 'tool' must answer a "
                                    "preceding assistant message with tool_calls", param=f"messages[{i}].role")
            if message.tool_call_id not in answerable:
                raise ApiError(400, f"messages[{i}].tool_call_id: {message.tool_call_id!r} is not "
                                    "among the tool_calls of the preceding assistant message",
                               param=f"messages[{i}].tool_call_id")
            turn = template_result(message.tool_call_id, message.name or called.get(message.tool_call_id),
                                   turn["content"])
        out.append(turn)
    return out


def template_call(call_id: str, name: str, arguments: dict) -> dict:
    """An assistant's call as templates take it (Hugging Face's convention), from either API."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def template_result(call_id: str, name: Optional[str], content) -> dict:
    """A tool's answer to a call as templates take it, from either API: a `tool` turn with
    the call's id and its function's name."""
    return {"role": "tool", "content": content, "tool_call_id": call_id, **({"name": name} if name else {})}


def native_tool_turns(messages: list[dict]) -> list[dict]:
    """Template messages in the form of templates that read `message.tool_responses`
    (Gemma 4's own): the model writes its calls, reads their answers and goes on in one
    turn. So the tool turns answering an assistant's calls become that message's
    `tool_responses` ({"name", "response"}: a JSON object's text as the object, as Google's
    examples pass it; other text as it is), and an assistant's text right after them becomes
    the calling message's content when it has none of its own."""
    out: list[dict] = []
    for message in messages:
        last = out[-1] if out else {}
        if message["role"] == "tool" and last.get("tool_calls"):
            last.setdefault("tool_responses", []).append(
                {"name": message.get("name"), "response": _response(message["content"])})
        elif (message["role"] == "assistant" and not message.get("tool_calls")
              and last.get("tool_responses") and not last.get("content")):
            last["content"] = message["content"]
        else:
            out.append(dict(message))
    return out


def _response(text):
    try:
        value = parse_json(text, "content") if isinstance(text, str) else text
    except ApiError:
        return text
    return value if isinstance(value, dict) else text


def _arguments(text: str, where: str) -> dict:
    value = parse_json(text, where)  # as strict as a body: no NaN, depth, long integers
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: must be a JSON object", param=where)
    return value


def new_call_id(prefix: str = "call") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------
# Reading calls out of the answer as it streams
# ---------------------------------------------------------------------------------------


@dataclass
class Call:
    name: str
    arguments: dict  # as strict JSON reads it back, so writing it cannot fail
    id: str


Event = Union[str, Call]


class CallText(str):
    """A call that did not parse, returned as the text the model wrote."""


class CallSplitter:
    """Splits streamed answer text into text and parsed `Call`s.

    Text that could still be the start of a start marker is held back until it cannot;
    from a start marker to its end marker the text is a call, handed to mlx-lm's parser
    when the end marker arrives (or the answer ends). A call that does not parse, names a
    function that was not offered, or has arguments with no strict JSON form, comes out as
    the text it was.
    """

    def __init__(self, plan: ToolPlan, strays: tuple[str, ...] = ()):
        self.plan = plan
        self.syntax = plan.syntax
        self.buffer = ""
        self.in_call = plan.forced  # a forced call's start marker ended the prompt
        self.calls = 0
        self.strays = strays  # marker texts left out of the text between calls

    def feed(self, text: str) -> list[Event]:
        return self._without_strays(self._feed(text))

    def finish(self) -> list[Event]:
        """What is left when the answer ends: an unterminated call is parsed as it is."""
        return self._without_strays(self._finish())

    def _without_strays(self, events: list[Event]) -> list[Event]:
        """Text between calls without `strays`; a call that did not parse stays the text it
        was, markers and all (`CallText`)."""
        if not self.strays:
            return events
        out = []
        for event in events:
            if isinstance(event, str) and not isinstance(event, CallText):
                for marker in self.strays:
                    event = event.replace(marker, "")
            if not isinstance(event, str) or event:
                out.append(event)
        return out

    def _feed(self, text: str) -> list[Event]:
        if self.syntax is None:
            return [text] if text else []
        self.buffer += text
        out: list[Event] = []
        while True:
            if self.in_call:
                end = self.buffer.find(self.syntax.end) if self.syntax.end else -1  # none: to the end
                if end < 0:
                    return out
                out += self._call(self.buffer[:end], self.syntax.end)
                self.buffer, self.in_call = self.buffer[end + len(self.syntax.end):], False
            else:
                start = self.buffer.find(self.syntax.start)
                if start < 0:
                    keep = partial_suffix(self.buffer, self.syntax.start)
                    text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    return out + ([text] if text else [])
                if start:
                    out.append(self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(self.syntax.start):], True

    def _finish(self) -> list[Event]:
        rest, self.buffer = self.buffer, ""
        if self.syntax is None or not rest and not self.in_call:
            return [rest] if rest else []
        if not self.in_call:
            return [rest]
        self.in_call = False
        return self._call(rest, "")

    def _call(self, body: str, end: str) -> list[Event]:
        try:
            parsed = self.syntax.parse(body, self.plan.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            events = [Call(c["name"], _strict_json(c["arguments"]), new_call_id()) for c in calls]
            if not events or any(not isinstance(c.arguments, dict) or c.name not in self.plan.names
                                 for c in events):
                raise ValueError("not a call to an offered function")
        except Exception:  # the parsers raise ValueError, KeyError, JSONDecodeError, ...
            return [CallText(self.syntax.start + body + end)]
        if self.plan.single:
            events = events[: max(0, 1 - self.calls)]
        self.calls += len(events)
        return events


def _strict_json(value):
    """`value` as strict JSON reads it back (tuples as arrays, keys as strings). The parsers'
    `json.loads` and `ast.literal_eval` also give NaN, Infinity, sets, bytes, complex numbers
    and lone surrogates, which have no such form: ValueError or TypeError."""
    return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8"))


def openai_call(call: Call, index: Optional[int] = None) -> dict:
    """A call in OpenAI's shape (arguments as JSON text); `index` for a streamed delta."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}
