"""Anthropic's request bodies: `/v1/messages` (`MessagesRequest`) and its `count_tokens`
(`CountRequest`), on `request_base.RequestBody`, and what they make for the chat template.

A request is turned into the chat-template messages the OpenAI route builds (`system` as a
system turn, `tool_use` blocks as an assistant's calls, `tool_result` blocks as tool
turns, `thinking` blocks as the turn's `reasoning_content`, `image` blocks as image parts):
`template_messages`; its tools and tool_choice into a `tools.ToolPlan`: `tool_plan`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import ConfigDict, Field

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.body_bounds import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_STOP_SEQUENCES,
    MAX_TOOLS,
    bounded_stops,
)
from mlx_spec.server.request_base import Items, RequestBody, StrictModel
from mlx_spec.server.tools import ToolPlan, plan_tools, template_call, template_result


class Block(StrictModel):
    # Any block type parses, so an unsupported one is refused by name.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None
    id: Optional[str] = None  # tool_use
    name: Optional[str] = None
    input: Optional[dict] = None
    thinking: Optional[str] = None  # thinking
    signature: Optional[str] = None
    tool_use_id: Optional[str] = None  # tool_result
    content: Union[str, Items("Block", MAX_CONTENT_PARTS), None] = None
    is_error: Optional[bool] = None
    source: Optional[dict] = None  # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}


class AnthropicMessage(StrictModel):
    # "system": Claude Code sends system text inside `messages` too; it joins the system turn
    role: Literal["user", "assistant", "system"]
    content: Union[str, Items(Block, MAX_CONTENT_PARTS)]


class AnthropicTool(StrictModel):
    type: Optional[Literal["custom"]] = None  # server tools (web search, bash, ...) are Anthropic's
    name: str = Field(min_length=1)
    description: Optional[str] = None
    input_schema: dict


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(StrictModel):
    # "adaptive": the model decides how much to think (Claude Code's default): thinking on
    # where the model thinks, with no budget; off where it cannot
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None


# `context_management.edits` Anthropic defines: clearing earlier thinking is honoured
# (`clear_thinking`); clearing old tool results is a server-side trim of a long context, which
# a prompt that fits needs not, so it is accepted and changes nothing.
CONTEXT_EDITS = ("clear_thinking_20251015", "clear_tool_uses_20250919")


class ContextEdit(StrictModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    keep: Union[str, dict, None] = None  # clear_thinking: "all" or {"type": "thinking_turns", "value": N}


class ContextManagement(StrictModel):
    edits: Optional[Items(ContextEdit, MAX_TOOLS)] = None


class MessagesRequest(RequestBody):
    MAX_TEMPERATURE: ClassVar[float] = 1.0  # Anthropic's API range
    FORMAT_PARAM: ClassVar[str] = "output_config.format"
    max_tokens: int = Field(ge=1)  # required by the Messages API
    messages: Items(AnthropicMessage, MAX_MESSAGES, min_length=1)
    system: Union[str, Items(Block, MAX_CONTENT_PARTS), None] = None
    stop_sequences: Optional[Items(str, MAX_STOP_SEQUENCES)] = None
    tools: Optional[Items(AnthropicTool, MAX_TOOLS)] = None
    tool_choice: Optional[ToolChoice] = None
    metadata: Optional[dict] = None
    thinking: Optional[ThinkingConfig] = None
    # Features this server cannot give: refused by name rather than quietly ignored.
    output_config: Optional[dict] = None
    mcp_servers: Optional[Items(Any, MAX_TOOLS)] = None
    container: Union[str, dict, None] = None
    context_management: Optional[ContextManagement] = None

    def refuse_unsupported(self) -> None:
        unsupported = [("mcp_servers", bool(self.mcp_servers), "MCP servers are not supported"),
                       ("container", self.container is not None, "containers are not supported")]
        for param, bad, message in unsupported:
            if bad:
                raise ApiError(400, f"{param}: {message}", param=param)
        for i, edit in enumerate((self.context_management and self.context_management.edits) or []):
            if edit.type not in CONTEXT_EDITS:
                raise ApiError(400, f"context_management.edits[{i}].type: {edit.type!r} is not supported; "
                                    f"use one of {', '.join(CONTEXT_EDITS)}",
                               param=f"context_management.edits[{i}].type")

    def thinking_turns_kept(self) -> Optional[int]:
        """Assistant turns, counted from the last, whose thinking stays in the prompt under a
        `clear_thinking` edit; None: all of them (no edit, or `keep: "all"`). Anthropic's
        default keeps the last turn's."""
        edits = (self.context_management and self.context_management.edits) or []
        i, edit = next(((i, e) for i, e in enumerate(edits) if e.type == "clear_thinking_20251015"), (0, None))
        if edit is None or edit.keep == "all":
            return None
        if edit.keep is None:
            return 1
        value = edit.keep.get("value") if isinstance(edit.keep, dict) else None
        if not (isinstance(edit.keep, dict) and edit.keep.get("type") == "thinking_turns"
                and isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            param = f"context_management.edits[{i}].keep"
            raise ApiError(400, f"{param}: use \"all\" or {{\"type\": \"thinking_turns\", \"value\": N}} "
                                "with N at least 0", param=param)
        return value

    def output_format(self) -> Optional[tuple[str, Optional[dict]]]:
        """`output_config.format` ({"type": "json_schema", "schema": ...}) as a grammar, or None."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "output_config.format: only {\"type\": \"json_schema\", \"schema\": {...}} "
                                "is supported", param="output_config.format")
        return "json_schema", fmt["schema"]

    def thinking_on(self, think) -> bool:
        """Whether the model thinks: `thinking` enabled, or adaptive on a model that can
        (`think`: its thought markers)."""
        kind = self.thinking.type if self.thinking is not None else "disabled"
        return kind == "enabled" or (kind == "adaptive" and think is not None)

    def template_kwargs(self, think) -> dict:
        """enable_thinking for the template: on with `thinking` enabled (or adaptive), else
        off (Anthropic's default, whatever the tokenizer's). A model with no thought markers
        cannot think: enabled is refused, adaptive is off."""
        if self.thinking is not None and self.thinking.type == "enabled" and think is None:
            raise ApiError(400, "thinking: this model does not think (its tokenizer has no "
                                "thought markers)", param="thinking")
        return {"enable_thinking": self.thinking_on(think)} if think is not None else {}

    def thought_budget(self) -> Optional[int]:
        """Thought tokens before the thought is closed: less than max_tokens, as Anthropic's
        API requires (its minimum of 1024 is not kept, so small models can take small ones).
        Adaptive thinking has none: the model closes its thought itself."""
        if self.thinking is None or self.thinking.type != "enabled":
            return None
        budget = self.thinking.budget_tokens
        if budget is None:
            raise ApiError(400, "thinking.budget_tokens: Field required", param="thinking.budget_tokens")
        if not 1 <= budget < self.max_tokens:
            raise ApiError(400, "thinking.budget_tokens: must be at least 1 and less than max_tokens",
                           param="thinking.budget_tokens")
        return budget

    def stops(self) -> tuple[str, ...]:
        # Anthropic sets no count limit, so only their total length is bounded.
        return bounded_stops(tuple(self.stop_sequences or ()), "stop_sequences")

    def logprob_count(self) -> None:
        return None


class CountRequest(MessagesRequest):
    max_tokens: Optional[int] = None


def _text(content, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, block in enumerate(content):
        if block.type != "text":
            raise ApiError(400, f"{where}[{j}]: {block.type} blocks are not supported here; this "
                                "server takes text only", param=f"{where}[{j}]")
        _check_text(block, f"{where}[{j}]")
    return "".join(block.text for block in content)


def _image_part(block: Block, where: str) -> dict:
    """An image block as the template part `server.images.take_images` reads."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise ApiError(400, f"{where}.source: an image block needs a base64 source with `data` or a url "
                            "source with `url`", param=f"{where}.source")
    return {"type": "image", "url": url, "where": where, "kind": "image"}


def _check_text(block: Block, where: str) -> None:
    if block.text is None:
        raise ApiError(400, f"{where}: a text block needs a string `text`", param=f"{where}.text")
    if not block.text:  # Anthropic's rule and words
        raise ApiError(400, f"{where}.text: text content blocks must be non-empty", param=f"{where}.text")


def template_messages(body: MessagesRequest) -> tuple[list[dict], bool]:
    """The conversation as chat templates take it (OpenAI's roles, Hugging Face's tool
    convention), as `tools.template_messages` builds it for the OpenAI route, and whether
    its last turn is an assistant prefill that the answer continues (Anthropic's
    prefill: the turn stays open; an empty one is no prefill). Refused as Anthropic's API
    refuses them: empty content but in a final assistant turn, tool blocks without
    `tools`, a tool_result answering no tool_use of the message before, a prefill ending
    in whitespace."""
    # System text, the `system` field's then each system message's in order, is one system
    # turn: a template takes it first (Gemma's only there), and it stays the prompt's prefix
    # from request to request, so a cached conversation is read back.
    system = [_text(body.system, "system")] if body.system else []
    system += [_text(m.content, f"messages[{i}].content") for i, m in enumerate(body.messages)
               if m.role == "system"]
    out = [{"role": "system", "content": "\n\n".join(t for t in system if t)}] if any(system) else []
    called: dict[str, str] = {}  # tool_use id -> function name
    previous: set[str] = set()  # tool_use ids of the message before
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        if message.role == "system":
            continue
        if not message.content and not (i == last and message.role == "assistant"):
            raise ApiError(400, f"messages[{i}]: all messages must have non-empty content except "
                                "for the optional final assistant message", param=where)
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            previous = set()
            continue
        text, calls, uses, thought, images = [], [], set(), [], False
        for j, block in enumerate(message.content):
            if block.type in ("tool_use", "tool_result") and not body.tools:
                raise ApiError(400, f"{where}[{j}]: requests which include `tool_use` or "
                                    "`tool_result` blocks must define tools", param="tools")
            if block.type == "text":
                _check_text(block, f"{where}[{j}]")
                text.append(block.text)
            elif block.type == "image" and message.role == "user":
                text.append(_image_part(block, f"{where}[{j}]"))  # in its place among the text
                images = True
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                # An earlier thought, for templates that show them (Gemma 4's drops them);
                # a redacted one is Anthropic's ciphertext, which no template can read.
                if block.type == "thinking" and block.thinking:
                    thought.append(block.thinking)
            elif block.type == "tool_use" and message.role == "assistant":
                if not (block.id and block.name):
                    raise ApiError(400, f"{where}[{j}]: a tool_use block needs an `id` and a `name`",
                                   param=f"{where}[{j}]")
                calls.append(template_call(block.id, block.name, block.input or {}))
                called[block.id] = block.name
                uses.add(block.id)
            elif block.type == "tool_result" and message.role == "user":
                if block.tool_use_id not in previous:
                    raise ApiError(400, f"{where}[{j}]: a tool_result block must answer a tool_use "
                                        f"block of the previous message, and {block.tool_use_id!r} "
                                        "answers none", param=f"{where}[{j}].tool_use_id")
                out.append(template_result(block.tool_use_id, called[block.tool_use_id],
                                           _text(block.content, f"{where}[{j}].content")))
            else:
                raise ApiError(400, f"{where}[{j}]: {block.type} blocks are not supported in "
                                    f"{message.role} messages", param=f"{where}[{j}]")
        previous = uses
        if text or calls or message.role == "assistant":
            turn = {"role": message.role, "content": "".join(text) if not images else
                    [{"type": "text", "text": t} if isinstance(t, str) else t for t in text]}
            if thought:
                turn["reasoning_content"] = "".join(thought)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    _clear_thinking(out, body.thinking_turns_kept())
    prefill = body.messages[last].role == "assistant" and "tool_calls" not in out[-1]
    if prefill and not out[-1]["content"]:
        out.pop()  # an empty final assistant turn: the model's turn opens as usual
        return out, False
    if prefill and out[-1]["content"] != out[-1]["content"].rstrip():
        raise ApiError(400, f"messages[{last}]: final assistant content cannot end with trailing "
                            "whitespace", param=f"messages[{last}].content")
    return out, prefill


def _clear_thinking(turns: list[dict], kept: Optional[int]) -> None:
    """Drop earlier thoughts from all but the last `kept` assistant turns (`clear_thinking`;
    None keeps all). Templates that show thoughts of history then show only those."""
    if kept is None:
        return
    assistants = [turn for turn in turns if turn["role"] == "assistant"]
    for turn in assistants[:len(assistants) - kept]:
        turn.pop("reasoning_content", None)


def tool_plan(body: MessagesRequest, syntax) -> ToolPlan:
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                               **({"description": t.description} if t.description else {})}}
             for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise ApiError(400, "tool_choice.name: a tool choice of type tool needs a name",
                       param="tool_choice.name")
    named = {None: None, "auto": "auto", "any": "required", "none": "none"}
    # A forced tool's input follows its input_schema in the model's call syntax (`tools.py`).
    return plan_tools(tools or None, choice.name if choice and choice.type == "tool"
                      else named[choice.type if choice else None], syntax,
                      single=bool(choice and choice.disable_parallel_tool_use))
