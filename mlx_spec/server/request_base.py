"""What every request model shares, and a raw body made one of them.

A body is read as strict JSON within `body_bounds`, then validated by a pydantic model:
known fields must have the right types (strict: "0.5" is not a number), every list within
its `MAX_*` length (`Items`), and sampling values go through `SamplingParams` (temperature
within the API's range). Parsing a 16 MiB body is up to ~0.5 s of CPU work: the routes run
`parse_body` off the event loop. Fields that would change the answer's meaning and that we
do not implement (`logit_bias`, `echo` but on completions, ...) are refused; other unknown fields are ignored,
as clients send many we have no use for. Every failure becomes an `ApiError` whose message
names the field (`_validation_message`). `RequestBody` holds the fields both APIs take;
`openai_requests` and `anthropic_requests` build their requests on it.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlx_spec.core.sampling import SamplingParams
from mlx_spec.errors import MlxSpecError
from mlx_spec.server.api_error import ApiError
from mlx_spec.server.body_bounds import MAX_STOPS, MAX_TOOLS, bounded_stops, load_json


class StrictModel(BaseModel):
    # strict: "0.5" is not a number and true is not 1, as in OpenAI's own API
    model_config = ConfigDict(extra="ignore", strict=True)


def Items(item, limit: Optional[int] = None, min_length: int = 0):
    """A list of `min_length` to `limit` items (its length is checked before any item),
    read up to its first bad item: a union over lists would otherwise report every item of
    each member, millions of errors for a long list."""
    return Annotated[list[item], Field(min_length=min_length, max_length=limit, fail_fast=True)]


class StreamOptions(StrictModel):
    include_usage: bool = False


class RequestBody(StrictModel):
    """The fields both APIs take: the model, sampling, stops, streaming, keep-alive."""

    MAX_TEMPERATURE: ClassVar[float] = 2.0  # OpenAI's API range (Anthropic's: 1)
    FORMAT_PARAM: ClassVar[str] = "response_format"  # the field `output_format` reads, for errors
    ECHO: ClassVar[bool] = False  # whether `echo` is served (completions only)
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
    # vLLM's: control tokens (`<|turn>`, `<bos>`) left out of the answer's text (default)
    skip_special_tokens: Optional[bool] = None

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
                       ("echo", bool(self.echo) and not self.ECHO, "echo is not supported"),
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


def _sampling_param(message: str) -> Optional[str]:
    for name in ("temperature", "top-k", "top-p", "min-p", "repetition penalty", "seed"):
        if message.startswith(name):
            return name.replace("-", "_").replace(" ", "_")
    return None


def parse_body(raw: bytes, model: type[RequestBody]) -> RequestBody:
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


def _json_kind(value) -> str:
    """What a JSON value is, in a few words ("a list", "null")."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return {str: "a string", list: "a list"}.get(type(value), "a number")


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
