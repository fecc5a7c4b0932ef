"""The OpenAI wire format: request bodies in, response objects and error bodies out.

Requests are checked here before they reach the device (the Host, key, content type and
size were checked before, in `guards`): the body must be UTF-8 JSON, nested at most
`MAX_JSON_DEPTH` deep, with at most `MAX_JSON_VALUES` values and `MAX_JSON_OBJECTS`
objects (counted on its bytes before it is parsed), whose strings are valid Unicode (a lone
surrogate such as "\\ud800" cannot be tokenized) and whose integers Python can read
(`parse_json`, which also reads the JSON that a call's `arguments` string holds); known
fields must have the right types, every list within its `MAX_*` length (checked before its
items are), and sampling values go through `SamplingParams` (temperature within the API's
range). Parsing a 16 MiB body is up to ~0.5 s of CPU work: the app runs `parse_body` off
the event loop. Fields that would change the answer's meaning and that we do not implement
(`logit_bias`, `echo`, ...) are refused; other unknown fields
are ignored, as clients send many we have no use for. Every failure becomes an `ApiError`,
which the app turns into OpenAI's error shape `{"error": {"message", "type", "param",
"code"}}`.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
import sys
import time
import uuid
from dataclasses import replace
from typing import Annotated, Any, Callable, ClassVar, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlx_spec.errors import MlxSpecError
from mlx_spec.models.fast_tokenizer import token_bytes_reader
from mlx_spec.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_JSON_DEPTH = 64  # no request nests deeper; json.loads would recurse past Python's limit
# What one body may hold. json.loads keeps the GIL while it builds every value (~0.1-0.2 µs
# each; 16 MiB of "[]," is 5.6M values, ~1 s) and so does pydantic while it makes most
# objects a model (~3-10 µs each): these keep each step near 0.2 s, and lie well above a
# long agent session (a few thousand objects: messages, blocks, calls, tool schemas).
MAX_JSON_VALUES = 1 << 20  # list items and object members, all together
MAX_JSON_OBJECTS = 1 << 15
MAX_PROMPT_IDS = 1 << 18  # a completions prompt of token ids: a 256k context, twice Gemma 3's
MAX_MESSAGES = 20_000
MAX_CONTENT_PARTS = 10_000  # in one message's content (or Anthropic's system, a tool result)
MAX_TOOLS = 1024  # OpenAI's API takes 128; agents with many MCP servers send more
MAX_TOOL_CALLS = 1024  # in one assistant message
MAX_STOP_SEQUENCES = 256  # Anthropic's stop_sequences (OpenAI's stop: MAX_STOPS)
MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256  # the matcher holds back up to this much text per round
MAX_STOP_TEXT = MAX_STOPS * MAX_STOP_CHARS  # all stop strings together (Anthropic's have no count limit)


class ApiError(Exception):
    """An error answered in OpenAI's shape; `headers` travel with it (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# ---------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: "0.5" is not a number and true is not 1, as in OpenAI's own API
    model_config = ConfigDict(extra="ignore", strict=True)


def Items(item, limit: Optional[int] = None, min_length: int = 0):
    """A list of `min_length` to `limit` items (its length is checked before any item),
    read up to its first bad item: a union over lists would otherwise report every item of
    each member, millions of errors for a long list."""
    return Annotated[list[item], Field(min_length=min_length, max_length=limit, fail_fast=True)]


class ImageURL(_Strict):
    url: str
    detail: Optional[str] = None  # OpenAI's resolution hint; the processor decides here


class ContentPart(_Strict):
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


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
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


class FunctionSpec(_Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    MAX_TEMPERATURE: ClassVar[float] = 2.0  # OpenAI's API range (Anthropic's: 1)
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, Items(str), None] = None  # at most MAX_STOPS: `stops`
    # Clients send null for options they leave unset, so every optional field accepts it.
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    # Accepted only at their no-op values (checked in `sampling`): each changes the answer.
    logit_bias: Optional[dict] = None
    response_format: Optional[dict] = None
    functions: Optional[Items(Any, MAX_TOOLS)] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    # Ollama's: how long the model stays loaded after this request ("5m", 300, -1: always)
    keep_alive: Union[str, float, None] = None

    def keep_alive_seconds(self) -> Optional[float]:
        """The request's keep-alive in seconds (`worker.keep_alive_seconds`), None if unset."""
        from mlx_spec.server.worker import keep_alive_seconds

        if self.keep_alive is None:
            return None
        try:
            return keep_alive_seconds(self.keep_alive)
        except ValueError as error:
            raise ApiError(400, f"keep_alive: {error}", param="keep_alive",
                           code="invalid_value") from None

    def output_format(self) -> Optional[tuple[str, Optional[dict]]]:
        """`response_format` as a grammar: ("json_schema", schema), ("json_object", None), or
        None for text. A schema the grammar library cannot take is refused when compiled."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return "json_object", None
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema: a JSON schema object is required",
                               param="response_format.json_schema.schema", code="invalid_value")
            return "json_schema", schema
        raise ApiError(400, f"response_format.type: {kind!r} is not supported; use text, json_object "
                            "or json_schema", param="response_format.type", code="unsupported_parameter")

    def requested_tokens(self) -> Optional[int]:
        """max_completion_tokens (OpenAI's current name) over max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def stops(self) -> tuple[str, ...]:
        """The stop strings, at most `MAX_STOPS` (OpenAI's rule), each bounded."""
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings are allowed, not "
                                f"{len(stops)}", param="stop", code="invalid_value")
        return bounded_stops(stops, "stop")

    def sampling(self, defaults: SamplingParams) -> SamplingParams:
        """The request's values over the server's defaults, checked by `SamplingParams`."""
        unsupported = [("n", self.n not in (None, 1), "only n = 1 is supported"),
                       ("frequency_penalty", bool(self.frequency_penalty),
                        "frequency_penalty is not supported; use repetition_penalty"),
                       ("presence_penalty", bool(self.presence_penalty),
                        "presence_penalty is not supported; use repetition_penalty"),
                       ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
                       ("functions", bool(self.functions), "functions are not supported"),
                       ("echo", bool(self.echo), "echo is not supported"),
                       ("best_of", self.best_of not in (None, 1), "only best_of = 1 is supported"),
                       ("suffix", bool(self.suffix), "suffix is not supported"),
                       ("stream_options", self.stream_options is not None and not self.stream,
                        "stream_options is only allowed when stream is true")]
        for param, bad, message in unsupported:
            if bad:
                raise ApiError(400, message, param=param, code="unsupported_parameter")
        if self.temperature is not None and not 0 <= self.temperature <= self.MAX_TEMPERATURE:
            raise ApiError(400, f"temperature: must be between 0 and {self.MAX_TEMPERATURE:g}, not "
                                f"{self.temperature:g}", param="temperature", code="invalid_value")
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        try:
            return replace(defaults, **given)
        except MlxSpecError as error:
            raise ApiError(400, str(error), param=_sampling_param(str(error)),
                           code="invalid_value") from None


class ChatRequest(_Common):
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


class CompletionRequest(_Common):
    # A list holding one prompt is what LangChain's client sends; more would be n > 1.
    prompt: Union[str, Items(int, MAX_PROMPT_IDS), Items(str, MAX_PROMPT_IDS),
                  Items(Items(int, MAX_PROMPT_IDS), MAX_PROMPT_IDS)]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

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


def bounded_stops(stops: tuple[str, ...], param: str) -> tuple[str, ...]:
    """`stops` if the matcher's work per round stays small: it grows with their total
    length, so each is at most `MAX_STOP_CHARS` and all together `MAX_STOP_TEXT`."""
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"{param}: a stop string may have at most {MAX_STOP_CHARS} "
                            "characters", param=param, code="invalid_value")
    if sum(map(len, stops)) > MAX_STOP_TEXT:
        raise ApiError(400, f"{param}: the stop strings may have at most {MAX_STOP_TEXT} "
                            "characters together", param=param, code="invalid_value")
    return stops


def _sampling_param(message: str) -> Optional[str]:
    for name in ("temperature", "top-k", "top-p", "min-p", "repetition penalty", "seed"):
        if message.startswith(name):
            return name.replace("-", "_").replace(" ", "_")
    return None


def parse_body(raw: bytes, model: type[_Common]) -> _Common:
    """A request model from a raw body, or an `ApiError` that says what is wrong."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_json_kind(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        failure = _validation_error(error)
    del data  # not kept alive by the error's traceback
    raise failure


def _validation_error(error: ValidationError) -> ApiError:
    """The 400 for pydantic's errors: a list past its limit first (a union over lists also
    reports that the list is not a string), else `_validation_message`'s."""
    errors = error.errors(include_url=False, include_input=False)
    too_long = next((e for e in errors if e["type"] == "too_long"), None)
    if too_long is None:
        message, param = _validation_message(errors)
        return ApiError(400, message, param=param)
    param = _param_path(too_long["loc"])
    return ApiError(400, f"{param or 'body'}: at most {too_long['ctx']['max_length']} items are allowed, "
                         f"not {too_long['ctx']['actual_length']}", param=param, code="too_many_items")


def _validation_message(errors: list) -> tuple[str, Optional[str]]:
    """(message, param) for pydantic's first error. A union (content: a string or a list of
    blocks) reports a failure per member: the deepest names what is wrong ("content[0].text:
    Input should be a valid string", not "content: Input should be a valid string"), and
    members failing at one place are all named."""
    param = _param_path(errors[0]["loc"])
    within = [(_param_path(e["loc"]) or "", e["msg"]) for e in errors]
    within = [(path, msg) for path, msg in within if path.startswith(param or "")]
    deepest = max((path for path, _ in within), key=len)
    messages = list(dict.fromkeys(msg for path, msg in within if path == deepest))
    param = deepest or None
    said = messages[0] + "".join(f" or {m[:1].lower()}{m[1:]}" for m in messages[1:])
    return f"{param or 'body'}: {said}", param


def load_json(raw: bytes):
    """The JSON value of a body: UTF-8, then `parse_json`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {error.start})") from None
    return parse_json(text, encoded=raw)


def parse_json(text: str, where: Optional[str] = None, encoded: Optional[bytes] = None):
    """The value of strict JSON `text`: no NaN or Infinity, no integer past Python's digit
    limit, at most `MAX_JSON_DEPTH` deep, `MAX_JSON_VALUES` values and `MAX_JSON_OBJECTS`
    objects, and valid Unicode throughout. `where` names the field whose string holds the
    text (OpenAI's call arguments); None: the request body. `encoded`: `text` in UTF-8."""
    subject = where or "the request body"

    def refuse(reason: str, code: Optional[str] = None):
        raise ApiError(400, f"{subject} {reason}", param=where, code=code)

    _check_shape(encoded if encoded is not None else text.encode("utf-8", "surrogatepass"), refuse)
    try:
        data = json.loads(text, parse_constant=lambda name: refuse(f"is not valid JSON: {name} "
                                                                   "is not a JSON number"))
    except json.JSONDecodeError as error:
        refuse(f"is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})")
    except ValueError:  # int("...") past sys.get_int_max_str_digits(), which json.loads calls
        refuse(f"holds an integer of more than {sys.get_int_max_str_digits()} digits")
    except RecursionError:  # unbalanced, so `_check_shape` could not tell its depth
        refuse(f"is nested deeper than {MAX_JSON_DEPTH} levels")
    if _SURROGATE.search(text):  # only then can a string hold a lone one: find it
        _check_strings(data, where)
    return data


_BYTE = {name: ord(name) for name in '",[]{}'}
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")  # an escape that may make one, or one


def _check_shape(raw: bytes, refuse) -> None:
    """Values, objects and depth of the JSON text `raw`, counted before json.loads builds
    them (it keeps the GIL throughout): on the bytes outside strings, with numpy (which
    lets go of the GIL), so it is exact for valid JSON. A value follows each comma or
    opening bracket (or is the whole text); escaped backslashes and quotes go first, so
    every quote left opens or closes a string."""
    chars = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    quotes = chars == _BYTE['"']
    outside = (np.cumsum(quotes, dtype=np.uint8) & 1) == 0  # an even count of quotes before (mod 256)
    structure = chars[outside & ~quotes]
    count = {name: int(np.count_nonzero(structure == code)) for name, code in _BYTE.items() if name != '"'}
    opens, closes = count["["] + count["{"], count["]"] + count["}"]
    if 1 + count[","] + opens > MAX_JSON_VALUES:
        refuse(f"holds more than {MAX_JSON_VALUES} values (list items and object members)",
               "too_many_items")
    if opens and closes <= opens:  # more closes than opens: json.loads fails at once
        brackets = structure[np.isin(structure, (_BYTE["["], _BYTE["{"], _BYTE["]"], _BYTE["}"]))]
        steps = np.isin(brackets, (_BYTE["["], _BYTE["{"])).astype(np.int8) * 2 - 1
        if int(np.cumsum(steps, dtype=np.int32).max()) > MAX_JSON_DEPTH:
            refuse(f"is nested deeper than {MAX_JSON_DEPTH} levels")
    if count["{"] > MAX_JSON_OBJECTS:
        refuse(f"holds more than {MAX_JSON_OBJECTS} objects", "too_many_items")


def _json_kind(value) -> str:
    """What a JSON value is, in a few words ("a list", "null")."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return {str: "a string", list: "a list"}.get(type(value), "a number")


def _check_strings(data, where: Optional[str]) -> None:
    """Every string valid Unicode, walked with a stack (no recursion); a lone surrogate is
    reported at its path in the body, or at `where`."""
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, where or path)
            continue
        if isinstance(value, dict):
            for key in value:
                _check_unicode(key, where or path)
            children = [(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()]
        elif isinstance(value, list):
            children = [(item, f"{path}[{i}]") for i, item in enumerate(value)]
        else:
            continue
        stack += reversed(children)  # popped in document order: the first error is reported


def _check_unicode(value: str, path: str) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); no tokenizer can encode one."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        where = path or "body"
        raise ApiError(400, f"{where}: the text holds a lone surrogate "
                            f"(U+{ord(value[error.start]):04X}), which is not valid Unicode",
                       param=path or None, code="invalid_unicode") from None


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|.*\[.*\])$")


def _param_path(loc) -> Optional[str]:
    """'messages[1].content' from pydantic's location, without its union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _TYPE_TAG.match(part) and not part.startswith("function-"):
            path += f".{part}" if path else part
    return path or None


# ---------------------------------------------------------------------------------------
# Response objects
# ---------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_object(chat: bool, rid: str, model: str, text: str, finish: Optional[str],
                      usage_: dict, extra: dict, reasoning: str = "") -> dict:
    """A whole answer: `chat.completion` or `text_completion`; `extra` is the mlx_spec field,
    `reasoning` the thought (a chat message's `reasoning_content`, as vLLM and llama.cpp)."""
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if reasoning:
            choice["message"]["reasoning_content"] = reasoning
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_, "mlx_spec": extra}


def chunk_object(chat: bool, rid: str, model: str, created: int, *, text: Optional[str] = None,
                 role: bool = False, finish: Optional[str] = None, reasoning: str = "") -> dict:
    """One streamed piece: `chat.completion.chunk` (a delta) or `text_completion`."""
    choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        delta: dict = {"role": "assistant"} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(chat: bool, rid: str, model: str, created: int, usage_: dict, extra: dict) -> dict:
    """The last streamed object when stream_options.include_usage is set: no choices."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_,
            "mlx_spec": extra}


def token_describer(tokenizer, eos_ids) -> Callable[[int], tuple[str, bytes]]:
    """id -> (its label, the bytes it adds to the answer's text) for log-probs, cached.

    A label names one token: its text, or where its bytes are not whole UTF-8 alone (or it
    is a byte-fallback token, which would share an ASCII piece's text) "bytes:" and the
    bytes, escaped, as OpenAI's own completions API writes them ("bytes:\\xe2\\x80"); an id
    past the vocabulary is "token_id:N", as vLLM writes ids. So byte tokens of split
    characters no longer share the label U+FFFD, and joining every token's bytes gives the
    answer's text. An EOS id is labelled by its piece and adds no text."""
    read = token_bytes_reader(tokenizer)

    @functools.lru_cache(maxsize=1 << 16)
    def describe(token: int) -> tuple[str, bytes]:
        data, kind = read(token)
        if kind == "missing":
            label = f"token_id:{token}"
        else:
            try:
                label = data.decode("utf-8") if kind == "piece" else None
            except UnicodeDecodeError:
                label = None
            if label is None:
                label = "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}"
                                           for b in data)
        return label, b"" if token in eos_ids else data

    return describe


class AnswerBytes:
    """What each token of one answer adds to its text, followed across a stream's chunks:
    the token's bytes, less the space the answer starts with where the detokenizer drops it
    (`trims_first_space`), and the characters of text before it (completions'
    `text_offset`). Bytes go through an incremental UTF-8 decoder, so a character split
    over byte tokens counts once, and each of its tokens is at its start."""

    def __init__(self, trims_first_space: bool = False):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._trim = trims_first_space
        self.chars = 0

    def add(self, data: bytes) -> tuple[int, bytes]:
        """(the offset of a token adding `data`, the bytes it shows); moves past it."""
        if self._trim and data:
            self._trim, data = False, data[1:] if data.startswith(b" ") else data
        at, pending = self.chars, self._decoder.getstate()[0]
        if pending and data:  # a character cut short before this token is one U+FFFD
            probe = codecs.getincrementaldecoder("utf-8")("replace")
            at += probe.decode(pending + data[:1]).startswith("\ufffd")
        self.chars += len(self._decoder.decode(data))
        return at, data


def logprobs_object(chat: bool, scored: list, describe, answer: AnswerBytes) -> dict:
    """Log-probs of answer tokens in OpenAI's shape: chat's `{"content": [...]}` or the
    completions API's parallel lists. `scored`: (id, log-prob, [(id, log-prob)...]) per
    token, an EOS included (usage counts it); `describe`: `token_describer`'s; `answer`:
    the answer's `AnswerBytes` so far (a stream's), advanced in place."""
    labels, shown, offsets = [], [], []
    for t, _, _ in scored:
        label, data = describe(t)
        at, data = answer.add(data)
        labels.append(label)
        shown.append(data)
        offsets.append(at)
    if chat:
        def entry(t, lp):
            label, data = describe(t)
            return {"token": label, "logprob": lp, "bytes": list(data)}
        return {"content": [{"token": label, "logprob": lp, "bytes": list(data),
                             "top_logprobs": [entry(a, b) for a, b in top]}
                            for label, data, (_, lp, top) in zip(labels, shown, scored)]}
    return {"tokens": labels, "token_logprobs": [lp for _, lp, _ in scored],
            "top_logprobs": [_top_by_label(t, lp, top, describe) for t, lp, top in scored],
            "text_offset": offsets}


def _top_by_label(chosen: int, logprob: float, top: list, describe) -> dict:
    """Completions' top log-probs, keyed by label, likeliest first, with the chosen token
    under its own label (as OpenAI's: "up to logprobs + 1" entries). Labels name tokens;
    should two still meet, the less likely one is keyed "token_id:N"."""
    taken, pairs = {describe(chosen)[0]}, []
    for token, p in top:
        label = describe(token)[0]
        if token != chosen and label in taken:
            label = f"token_id:{token}"
        taken.add(label)
        pairs.append((label, p))
    if all(token != chosen for token, _ in top):
        pairs.append((describe(chosen)[0], logprob))
    return dict(pairs)


def sse(obj) -> bytes:
    """One Server-Sent Event carrying a JSON object (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")
