"""OpenAI's request bodies: `/v1/chat/completions` (`ChatRequest`: messages, tools, log-probs,
template options) and `/v1/completions` (`CompletionRequest`), on `request_base.RequestBody`."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import ConfigDict, Field

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.body_bounds import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_PROMPT_IDS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
)
from mlx_spec.server.request_base import Items, RequestBody, StrictModel


class ImageURL(StrictModel):
    url: str
    detail: Optional[str] = None  # OpenAI's resolution hint; the processor decides here


class ContentPart(StrictModel):
    # Any part type parses, so a non-text part is refused by name (`content_text`), not with
    # pydantic's union report.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None
    image_url: Optional[ImageURL] = None


Content = Union[str, Items(ContentPart, MAX_CONTENT_PARTS), None]


def content_text(content: Content, where: str) -> str:
    """The text of a message's content: a string, or a list of text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not content:  # OpenAI's own message and code
        raise ApiError(400, f"Invalid '{where}': empty array. Expected an array with minimum "
                            "length 1, but got an empty array instead.", param=where, code="empty_array")
    for i, part in enumerate(content):
        if part.type == "text" and part.text is None:
            raise ApiError(400, f"{where}[{i}]: a text part needs a string `text`",
                           param=f"{where}[{i}].text")
        if part.type != "text":
            raise ApiError(400, f"{where}[{i}]: {part.type} content is not supported; this server "
                                "takes text only", param=f"{where}[{i}]", code="unsupported_content")
    return "".join(part.text for part in content)


def template_content(content: Content, where: str) -> Union[str, list[dict]]:
    """A user message's content as chat templates take it: its text (`content_text`), or
    with image_url parts a list of text parts and image parts that carry their source
    (read by `server.images.take_images`)."""
    if not isinstance(content, list) or all(part.type != "image_url" for part in content):
        return content_text(content, where)
    parts = []
    for i, part in enumerate(content):
        if part.type != "image_url":
            parts.append({"type": "text", "text": content_text([part], where)})
        elif part.image_url is None:
            raise ApiError(400, f"{where}[{i}]: an image_url part needs an `image_url` object with a `url`",
                           param=f"{where}[{i}].image_url")
        else:
            parts.append({"type": "image", "url": part.image_url.url, "where": f"{where}[{i}]", "kind": "image_url"})
    return parts


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    tool_calls: Optional[Items(ToolCall, MAX_TOOL_CALLS)] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message answers this call
    name: Optional[str] = None
    reasoning_content: Optional[str] = None  # an assistant's earlier thought (as we answer it)

    def as_template_message(self, where: str = "content") -> dict:
        """The message as chat templates take it: "developer" is OpenAI's newer "system"; an
        earlier thought goes as `reasoning_content`, which templates that show thoughts of
        history read (Gemma 4's drops them)."""
        content = template_content(self.content, where) if self.role == "user" else content_text(self.content, where)
        turn = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.reasoning_content and self.role == "assistant":
            turn["reasoning_content"] = self.reasoning_content
        return turn


class FunctionSpec(StrictModel):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction



class ChatRequest(RequestBody):
    messages: Items(Message, MAX_MESSAGES, min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[Items(Tool, MAX_TOOLS)] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM's and transformers' names: continue the final assistant message (a prefill).
    continue_final_message: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    # vLLM's and llama.cpp's: extra variables for the chat template ({"enable_thinking": true})
    chat_template_kwargs: Optional[dict] = None

    def template_kwargs(self) -> dict:
        return checked_template_kwargs(self.chat_template_kwargs)

    def prompt_mode(self) -> tuple[bool, bool]:
        """(continue the final message, open a model turn) for the chat template."""
        if not self.continue_final_message:
            return False, self.add_generation_prompt is not False
        if self.add_generation_prompt:  # vLLM refuses the pair too
            raise ApiError(400, "continue_final_message: cannot be true together with "
                                "add_generation_prompt true", param="continue_final_message")
        last = len(self.messages) - 1
        final = self.messages[last]
        text = content_text(final.content, f"messages[{last}].content")
        if final.role != "assistant" or final.tool_calls or not text:
            raise ApiError(400, f"messages[{last}]: continue_final_message needs a final assistant "
                                "message with text (and no tool_calls) to continue",
                           param=f"messages[{last}]")
        return True, False

    def logprob_count(self) -> Optional[int]:
        """Alternatives per token when log-probs are asked for; None when they are not."""
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(RequestBody):
    ECHO: ClassVar[bool] = True  # the prompt before the answer; with logprobs, its log-probs
    # A list holding one prompt is what LangChain's client sends; more would be n > 1.
    prompt: Union[str, Items(int, MAX_PROMPT_IDS), Items(str, MAX_PROMPT_IDS),
                  Items(Items(int, MAX_PROMPT_IDS), MAX_PROMPT_IDS)]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: Optional[int] = Field(None, ge=0)  # 0 with echo: score the prompt only (lm-eval)

    def check_echo(self) -> None:
        """max_tokens 0 only with echo (the prompt's log-probs, nothing generated); echo is
        answered whole, not streamed."""
        if self.requested_tokens() == 0 and not self.echo:
            raise ApiError(400, "max_tokens: must be at least 1 (0 only with echo)", param="max_tokens",
                           code="invalid_value")
        if self.echo and self.stream:
            raise ApiError(400, "echo: not supported with stream; ask without streaming", param="echo",
                           code="unsupported_parameter")

    def single_prompt(self) -> Union[str, list[int]]:
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise ApiError(400, f"prompt: only one prompt per request is supported, not "
                                    f"{len(self.prompt)}", param="prompt",
                               code="unsupported_parameter")
            return self.prompt[0]
        return self.prompt

    def logprob_count(self) -> Optional[int]:
        return self.logprobs


# Variables the server sets itself, so a request's chat_template_kwargs may not.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize",
                                      "continue_final_message", "documents", "return_dict",
                                      "chat_template", "tokenizer", "bos_token", "eos_token"})


def checked_template_kwargs(kwargs: Optional[dict]) -> dict:
    """A request's chat_template_kwargs, refused where they name what the server sets."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise ApiError(400, f"chat_template_kwargs.{key}: this template variable cannot be "
                                "set by a request", param=f"chat_template_kwargs.{key}")
    return dict(kwargs or {})


class TokenizeRequest(StrictModel):
    """`POST /tokenize` in vLLM's form (`prompt` or `messages`, `add_special_tokens`, default
    true) or llama.cpp's (`content`, `add_special`, default false; `with_pieces`)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    content: Optional[str] = None
    messages: Optional[Items(Message, MAX_MESSAGES, min_length=1)] = None
    add_special_tokens: Optional[bool] = None
    add_special: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    with_pieces: Optional[bool] = None

    def text(self) -> Optional[str]:
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ApiError(400, "give exactly one of prompt, content (text) or messages (a chat)",
                           param="prompt")
        return self.prompt if self.prompt is not None else self.content

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS): vLLM's default with `prompt`,
        llama.cpp's with `content`."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        if self.add_special is not None:
            return self.add_special
        return self.content is None


class DetokenizeRequest(StrictModel):
    model: Optional[str] = None
    tokens: Items(int, MAX_PROMPT_IDS)
