"""Bounds on a request body: how much one may hold, and the checks on its bytes.

Requests are checked before they reach the device (the Host, key, content type and size
were checked before, in `guards`): the body must be UTF-8 JSON, nested at most
`MAX_JSON_DEPTH` deep, with at most `MAX_JSON_VALUES` values and `MAX_JSON_OBJECTS`
objects (counted on its bytes before it is parsed), whose strings are valid Unicode (a lone
surrogate such as "\\ud800" cannot be tokenized) and whose integers Python can read
(`parse_json`, which also reads the JSON that a call's `arguments` string holds). The
request models (`request_base`, `openai_requests`, `anthropic_requests`) hold every list
within its `MAX_*` length, checked before its items are, and stop strings within
`bounded_stops`. Every failure is an `ApiError`.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Optional

import numpy as np

from mlx_spec.server.api_error import ApiError

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
