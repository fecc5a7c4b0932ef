"""OpenAI's Responses API request body (`POST /v1/responses`: `ResponsesRequest`), on
`request_base.RequestBody`, and what it makes for the chat template.

Input items become the chat-template messages the chat completions route builds for the
same conversation (`template_conversation`): `instructions` as a first system turn; message
items by role ("developer" is "system"); `function_call` items as the calls of the
assistant turn they follow (a new turn with no text when none is open), `function_call_output`
items as tool turns answering the latest turn's calls; a `reasoning` item's text as the
`reasoning_content` of the assistant turn after it. So a greedy answer through
/v1/responses is the one chat completions gives for the same messages.

Tools: function tools, and the function tools of a `namespace` (Codex groups its agent tools
so; a call to one names its namespace), are offered through the chat template
(`tool_plan`). OpenAI's hosted tools (`web_search`, `file_search`, ...) and the client tool
kinds that are not functions (`custom`, `shell`, `apply_patch`, ...) are left out of the
prompt, not refused: Codex sends `web_search` with every request, and the model can still
answer. A tool type the API does not have is a 400.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar, Literal, Optional, Union

from pydantic import ConfigDict, Field

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.body_bounds import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, MAX_TOP_LOGPROBS, parse_json
from mlx_spec.server.request_base import Items, RequestBody, StrictModel
from mlx_spec.server.tools import ToolPlan, ToolSyntax, plan_tools, template_call, template_result

# Tool types of the API that are not functions the model writes: left out of the prompt.
UNOFFERED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "computer", "computer_use_preview", "mcp", "code_interpreter", "image_generation",
    "local_shell", "shell", "custom", "apply_patch", "tool_search", "programmatic_tool_calling"})
# `include` values: the log-probs are given; the rest name outputs of tools we never run, or
# encrypted reasoning (we keep no secret state: a reasoning item's text is its content).
INCLUDABLE = frozenset({
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs"})
LOGPROBS = "message.output_text.logprobs"
CHAT_TOOL_PATH = re.compile(r"tools\[(\d+)\]\.function\.")  # `plan_tools`' paths into the offered tools
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class Part(StrictModel):
    # Any part type parses, so an unsupported one is refused by name.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None
    image_url: Optional[str] = None  # input_image: a URL or a data URL
    file_id: Optional[str] = None
    refusal: Optional[str] = None


Content = Union[str, Items(Part, MAX_CONTENT_PARTS), None]


class InputItem(StrictModel):
    """One input item, of any type (refused by name in `template_conversation`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Optional[str] = None  # "message" when left out (the API's easy input message)
    id: Optional[str] = None
    role: Optional[str] = None  # message
    content: Content = None  # message; reasoning's text
    status: Optional[str] = None
    call_id: Optional[str] = None  # function_call, function_call_output
    name: Optional[str] = None
    namespace: Optional[str] = None
    arguments: Optional[str] = None
    output: Content = None  # function_call_output: text, or text parts
    summary: Optional[Items(Part, MAX_CONTENT_PARTS)] = None  # reasoning
    encrypted_content: Optional[str] = None


class ToolSpec(StrictModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None
    tools: Optional[Items("ToolSpec", MAX_TOOLS)] = None  # a namespace's


class NamedChoice(StrictModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    name: Optional[str] = None


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(StrictModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(StrictModel):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesRequest(RequestBody):
    FORMAT_PARAM: ClassVar[str] = "text.format"
    input: Union[str, Items(InputItem, MAX_MESSAGES), None] = None
    instructions: Optional[str] = None
    tools: Optional[Items(ToolSpec, MAX_TOOLS)] = None
    tool_choice: Union[str, NamedChoice, None] = None  # a string's value: checked in `tool_plan`
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: Optional[Items(str, 64)] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    user: Optional[str] = None
    # Features this server cannot give: refused by name rather than quietly ignored.
    background: Optional[bool] = None
    conversation: Union[str, dict, None] = None
    prompt: Optional[dict] = None

    def refuse_unsupported(self) -> None:
        unsupported = [("background", bool(self.background), "background responses are not supported"),
                       ("conversation", self.conversation is not None,
                        "conversations are not supported; use previous_response_id"),
                       ("prompt", self.prompt is not None, "stored prompt templates are not supported")]
        for param, bad, message in unsupported:
            if bad:
                raise ApiError(400, f"{param}: {message}", param=param, code="unsupported_parameter")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise ApiError(400, f"include[{i}]: {value!r} is not a supported value; supported: "
                                    f"{', '.join(sorted(INCLUDABLE))}", param=f"include[{i}]",
                               code="invalid_value")
        if not self.input and self.previous_response_id is None:
            raise ApiError(400, "input: an input (a string or at least one item) is required, or a "
                                "previous_response_id", param="input")
        # Chat completions' names for fields this API spells otherwise: refused with the name
        # to use, rather than quietly ignored.
        for param, instead in (("max_tokens", "max_output_tokens"), ("max_completion_tokens", "max_output_tokens"),
                               ("response_format", "text.format")):
            if getattr(self, param) is not None:
                raise ApiError(400, f"{param}: not a parameter of the Responses API; use {instead}",
                               param=param, code="unsupported_parameter")

    def requested_tokens(self) -> Optional[int]:
        return self.max_output_tokens

    def logprob_count(self) -> Optional[int]:
        """Alternatives per token when `include` asks for the text's log-probs, else None."""
        return (self.top_logprobs or 0) if LOGPROBS in (self.include or ()) else None

    def output_format(self) -> Optional[tuple[str, Optional[dict]]]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return "json_object", None
        if fmt.json_schema is None:
            raise ApiError(400, "text.format.schema: a JSON schema object is required for json_schema",
                           param="text.format.schema", code="invalid_value")
        return "json_schema", fmt.json_schema

    def template_kwargs(self, think) -> dict:
        """enable_thinking from `reasoning.effort` ("none"/"minimal": off, else on); the
        template's own default when no effort is given, as chat completions', and nothing
        for a model that does not think (the effort is a hint the API lets models ignore)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if think is None or effort is None:
            return {}
        return {"enable_thinking": effort not in ("none", "minimal")}

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputItem(type="message", role="user", content=self.input)]
        return list(self.input or ())


# ---------------------------------------------------------------------------------------
# Input items as chat-template messages
# ---------------------------------------------------------------------------------------


def template_conversation(items: list[InputItem], instructions: Optional[str],
                          syntax: Optional[ToolSyntax], first: int = 0) -> list[dict]:
    """The items (after `instructions`) as chat templates take them; `first`: the index in
    `input` of items[0] (earlier ones came from a stored response), for error paths."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    called: dict[str, str] = {}  # call id -> function name
    open_turn: Optional[dict] = None  # the assistant turn later calls join
    answerable: set[str] = set()  # that turn's call ids, while outputs follow
    reasoning: list[str] = []  # reasoning text waiting for the assistant turn it led to

    def assistant_turn(content: str) -> dict:
        turn = {"role": "assistant", "content": content}
        if reasoning:
            turn["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i - first}]" if i >= first else f"previous_response_id (its item {i})"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            role = item.role
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: must be one of user, assistant, system, developer, "
                                    f"not {role!r}", param=f"{where}.role", code="invalid_value")
            if role == "assistant":
                open_turn, answerable = assistant_turn(_text(item.content, f"{where}.content")), set()
            else:
                content = (_user_content(item.content, f"{where}.content") if role == "user"
                           else _text(item.content, f"{where}.content"))
                out.append({"role": "system" if role == "developer" else role, "content": content})
                open_turn, answerable = None, set()
        elif kind == "function_call":
            if syntax is None:
                raise _no_tool_format(where)
            for field in ("call_id", "name", "arguments"):
                if getattr(item, field) is None:
                    raise ApiError(400, f"{where}.{field}: Field required", param=f"{where}.{field}")
            if open_turn is None or (out and out[-1]["role"] == "tool"):
                open_turn, answerable = assistant_turn(""), set()
            elif reasoning:
                open_turn["reasoning_content"] = open_turn.get("reasoning_content", "") + "".join(reasoning)
                reasoning.clear()
            open_turn.setdefault("tool_calls", []).append(
                template_call(item.call_id, item.name, _arguments(item.arguments, f"{where}.arguments")))
            called[item.call_id] = item.name
            answerable.add(item.call_id)
        elif kind == "function_call_output":
            if syntax is None:
                raise _no_tool_format(where)
            if item.call_id is None:
                raise ApiError(400, f"{where}.call_id: Field required", param=f"{where}.call_id")
            if item.call_id not in answerable:
                raise ApiError(400, f"{where}.call_id: no function_call with call_id {item.call_id!r} "
                                    "comes before this output (among the latest calls)",
                               param=f"{where}.call_id")
            out.append(template_result(item.call_id, called.get(item.call_id),
                                       _text(item.output, f"{where}.output")))
        elif kind == "reasoning":
            texts = [p.text for p in (item.content if isinstance(item.content, list) else []) if p.text]
            reasoning += texts or [p.text for p in item.summary or () if p.text]
        elif kind is None:
            raise ApiError(400, f"{where}.type: Field required", param=f"{where}.type")
        else:
            raise ApiError(400, f"{where}.type: {kind!r} input items are not supported; supported: "
                                "message, function_call, function_call_output, reasoning",
                           param=f"{where}.type", code="unsupported_value")
    return out


def _text(content: Content, where: str) -> str:
    """A message's text: a string, or its text parts joined (a refusal's text as its text)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        text = part.refusal if part.type == "refusal" else part.text
        if part.type not in (*TEXT_PARTS, "refusal"):
            raise ApiError(400, f"{where}[{i}]: {part.type} content is not supported here; this "
                                "takes text parts", param=f"{where}[{i}].type", code="unsupported_content")
        if text is None:
            raise ApiError(400, f"{where}[{i}]: a {part.type} part needs a string `text`",
                           param=f"{where}[{i}].text")
        texts.append(text)
    return "".join(texts)


def _user_content(content: Content, where: str) -> Union[str, list[dict]]:
    """A user message's content: its text, or with input_image parts a list of text parts
    and image parts carrying their source (read by `server.images.take_images`)."""
    if not isinstance(content, list) or all(part.type != "input_image" for part in content):
        return _text(content, where)
    parts = []
    for i, part in enumerate(content):
        if part.type != "input_image":
            parts.append({"type": "text", "text": _text([part], where)})
        elif part.image_url is None:
            raise ApiError(400, f"{where}[{i}]: an input_image part needs an `image_url` (file_id is "
                                "not supported: this server keeps no files)", param=f"{where}[{i}].image_url")
        else:
            parts.append({"type": "image", "url": part.image_url, "where": f"{where}[{i}]", "kind": "input_image"})
    return parts


def _arguments(text: str, where: str) -> dict:
    value = parse_json(text, where)  # as strict as a body: no NaN, depth, long integers
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: must be a JSON object", param=where)
    return value


def _no_tool_format(where: str) -> ApiError:
    return ApiError(400, f"{where}: this model's chat template has no tool-call format, so it cannot "
                         "show tool calls or results", param=f"{where}.type", code="unsupported_parameter")


# ---------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------


def offered_tools(tools: Optional[list[ToolSpec]]) -> tuple[list[dict], dict[str, str], list[str]]:
    """(the function tools in chat completions' shape, as the chat template takes them;
    function name -> its namespace for those in one; each one's path in the request)."""
    out, namespaces, paths = [], {}, []

    def function(tool: ToolSpec, where: str) -> dict:
        if not tool.name:
            raise ApiError(400, f"{where}.name: a function tool needs a name", param=f"{where}.name")
        if tool.name in names:
            raise ApiError(400, f"{where}.name: another tool is also named {tool.name!r}", param=f"{where}.name")
        names.add(tool.name)
        paths.append(where)
        spec = {"name": tool.name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}
        return {"type": "function", "function": {k: v for k, v in spec.items() if v is not None}}

    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        if tool.type == "function":
            out.append(function(tool, f"tools[{i}]"))
        elif tool.type == "namespace":
            for j, inner in enumerate(tool.tools or ()):
                if inner.type == "function":
                    out.append(function(inner, f"tools[{i}].tools[{j}]"))
                    namespaces[inner.name] = tool.name
                elif inner.type not in UNOFFERED_TOOLS:
                    raise _unknown_tool(inner.type, f"tools[{i}].tools[{j}]")
        elif tool.type not in UNOFFERED_TOOLS:
            raise _unknown_tool(tool.type, f"tools[{i}]")
    return out, namespaces, paths


def _unknown_tool(kind: str, where: str) -> ApiError:
    return ApiError(400, f"{where}.type: {kind!r} is not a tool type of the Responses API",
                    param=f"{where}.type", code="invalid_value")


def tool_plan(body: ResponsesRequest, syntax: Optional[ToolSyntax]) -> tuple[ToolPlan, dict[str, str]]:
    """The request's `ToolPlan` (`tools.plan_tools`, as chat completions') and its tools'
    namespaces."""
    tools, namespaces, paths = offered_tools(body.tools)
    choice = body.tool_choice
    if isinstance(choice, NamedChoice):
        if choice.type != "function" or not choice.name:
            raise ApiError(400, f"tool_choice: only 'none', 'auto', 'required' or {{\"type\": \"function\", "
                                f"\"name\": ...}} are supported, not type {choice.type!r}",
                           param="tool_choice", code="unsupported_value")
        choice = choice.name
    elif choice not in (None, "none", "auto", "required"):
        raise ApiError(400, f"tool_choice: must be 'none', 'auto', 'required' or a function, not {choice!r}",
                       param="tool_choice", code="invalid_value")
    try:
        plan = plan_tools(tools or None, choice, syntax, single=body.parallel_tool_calls is False)
    except ApiError as error:  # its paths are chat completions' (tools[i].function.strict)
        def path(match: re.Match) -> str:
            return paths[int(match.group(1))] + "."

        error.param = error.param and CHAT_TOOL_PATH.sub(path, error.param)
        error.message = CHAT_TOOL_PATH.sub(path, error.message)
        raise
    return plan, namespaces


def arguments_text(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)
