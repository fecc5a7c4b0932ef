"""Structured output: grammars compiled against our tokenizer, and the per-request matcher
the round loop asks for allowed-token masks, forced tokens and rollback.

The constraint library is llguidance (chosen by `bench/grammar_libs.py`); this module only
adapts it. A `Grammar` is compiled once (JSON Schema, any JSON object, a regex, or a Lark
grammar as llguidance reads it) and `Grammar.matcher()` gives each request its own `Matcher`.

The matcher always rests at the committed tokens. Within a round the engine and the draft
model ask for masks along the draft's path (`mask_after(path)`): the matcher walks there
(consuming the tokens beyond the committed ones, rolling back what the previous question
walked and this one does not share) and the mask is cached per path until `commit`, so each
state's mask is computed once a round whoever asks. `commit` rolls back to the committed
state, then consumes the round's committed tokens.

Masks are bool arrays as wide as the tokenizer's vocabulary; `constrain` applies them to
logits of any width (Gemma 3 pads 262,144 ids to 262,208: the padding is never allowed). EOS ids are allowed exactly where the grammar accepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx

from mlx_spec.core.cache.sequence import common_prefix_length
from mlx_spec.errors import MlxSpecError, UsageError

KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON as json.dumps writes it, no other whitespace: key names, ": " and ", " become forced
# runs (free drafts) rather than choices. A schema's "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 128 * 1024  # a schema's JSON or a grammar's text: compiling grows faster than its size
# (10k Lark alternatives, 100 kB: 1 s; 40k, 430 kB: 14 s); OpenAI allows ~120k of names and values
ERROR_CHARS = 300  # of an llguidance error in ours: its dumps can hold the whole grammar
INT64 = (-(2**63), 2**63 - 1)  # llguidance's integers: a bound past them is clamped, not refused
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_LLG_TOKENIZERS: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer): ~3 s to build for Gemma


def _tokenizer_json(tokenizer) -> str:
    """The Hugging Face tokenizer.json behind mlx-lm's TokenizerWrapper or our FastTokenizer."""
    path = getattr(tokenizer, "_path", None)
    if path is not None and (Path(path) / "tokenizer.json").exists():
        return (Path(path) / "tokenizer.json").read_text()
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds transformers'
    backend = getattr(hf, "backend_tokenizer", hf)  # transformers' holds a `tokenizers.Tokenizer`
    if not hasattr(backend, "to_str"):
        raise MlxSpecError("structured output needs a fast (tokenizer.json) tokenizer")
    return backend.to_str()


def llg_tokenizer(tokenizer, eos_ids: Iterable[int] = ()):
    """llguidance's view of `tokenizer`, built once per tokenizer (per process).

    llguidance tokenizes the text a grammar forces (free drafts) with the tokenizer it is
    given. Read from tokenizer.json, that is Hugging Face's, which turns control-token text
    ("<eos>", "<start_of_turn>") inside a forced string into the control token, a token the
    grammar itself never allows (a control token is not its text): the draft left the
    grammar mid-generation. So llguidance gets the same vocabulary (every token's bytes
    and which are special, as it reads them from tokenizer.json) with an encoder that reads
    control-token text as plain text: HTML, markup and chat transcripts can be generated."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper
    from tokenizers import Tokenizer

    cached = _LLG_TOKENIZERS.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    eos = sorted(set(eos_ids) | set(getattr(tokenizer, "eos_token_ids", None) or []))
    text = _tokenizer_json(tokenizer)
    llt = llguidance.LLTokenizer(text, eos_token=eos or None)
    plain = Tokenizer.from_str(text)
    plain.encode_special_tokens = True  # "<eos>" in text is five characters, not EOS
    plain.no_padding()
    plain.no_truncation()
    llt = llguidance.LLTokenizer(TokenizerWrapper(_PlainText(llt, plain)), eos_token=eos or None)
    _LLG_TOKENIZERS[id(tokenizer)] = (tokenizer, llt)
    return llt


class _PlainText:
    """What llguidance's `TokenizerWrapper` reads: `llt`'s tokens (bytes) and special ids,
    and `plain` (a `tokenizers.Tokenizer` that never matches control-token text) to encode."""

    def __init__(self, llt, plain):
        self.tokens = [llt.decode_bytes([i]) for i in range(llt.vocab_size)]
        self.special_token_ids = [i for i in range(llt.vocab_size) if llt.is_special_token(i)]
        self.eos_token_id = llt.eos_token
        self.bos_token_id = None
        self._plain = plain

    def __call__(self, text):
        if not isinstance(text, str):  # the wrapper probes with bytes: it then sends str
            raise TypeError("text only")
        return self._plain.encode(text, add_special_tokens=False).ids


@dataclass(frozen=True)
class Grammar:
    """A grammar compiled against one tokenizer; `matcher()` starts a request on it."""

    kind: str  # one of KINDS
    source: str  # the schema (JSON text), regex or Lark text, as given
    compiled: object  # an llguidance LLMatcher at the start state, copied per request
    vocab: int  # the tokenizer's ids (a model's logits may be wider: padding)

    def matcher(self, eos_ids: Iterable[int] = ()) -> "Matcher":
        return Matcher(self.compiled.deep_copy(), self.vocab, eos_ids)


def compile_grammar(tokenizer, kind: str, source, eos_ids: Iterable[int] = ()) -> Grammar:
    """Compile a grammar of `kind` (see KINDS) for `tokenizer`.

    Args:
        source: for json_schema a dict or JSON text; for regex / lark their text; ignored
            for json_object (any JSON object).
    Raises:
        UsageError (one line, never echoing the source): a schema that is not JSON; one over
            `MAX_GRAMMAR_CHARS`; one llguidance cannot compile or does not support (its
            message names the feature, e.g. 'Unimplemented keys: ["not"]'); an integer
            bound it cannot enforce; one no text satisfies (the start state allows nothing).
    """
    import llguidance

    if kind not in KINDS:
        raise UsageError(f"unknown grammar kind {kind!r}: choose one of {', '.join(KINDS)}")
    label = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex",
             "lark": "grammar"}[kind]
    if kind == "json_object":
        source = {"type": "object"}
    if isinstance(source, str) and len(source) > MAX_GRAMMAR_CHARS:
        raise UsageError(f"the {label} is too large: {len(source):,} characters, at most {MAX_GRAMMAR_CHARS:,}")
    if kind in ("json_schema", "json_object"):
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as e:
                raise UsageError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(source, dict):
            raise UsageError("the JSON schema must be a JSON object")
        text = json.dumps(source)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise UsageError(f"the JSON schema is too large: {len(text):,} characters, at most {MAX_GRAMMAR_CHARS:,}")
        _check_integer_bounds(source)
        schema = closed_objects(source) if kind == "json_schema" else source
        make = lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # noqa: E731
    elif kind == "regex":
        text, make = source, lambda: llguidance.LLMatcher.grammar_from_regex(source)
    else:
        text, make = source, lambda: llguidance.LLMatcher.grammar_from_lark(source)
    llt = llg_tokenizer(tokenizer, eos_ids)
    try:
        grammar = make()
        matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
    except ValueError as e:
        raise UsageError(f"the {label} cannot be used: {_one_line(e)}") from None
    except BaseException as e:  # llguidance's Rust panics reach Python as pyo3's PanicException
        if type(e).__name__ != "PanicException":
            raise
        raise UsageError(f"the {label} cannot be used: it is too large or complex to compile") from None
    if matcher.is_error():
        raise UsageError(f"the {label} cannot be used: {_one_line(matcher.get_error())}")
    if not _satisfiable(matcher):
        raise UsageError(f"the {label} is unsatisfiable: no text matches it (a $ref to itself, "
                         "a $ref loop, an empty language)")
    return Grammar(kind, text, matcher, llt.vocab_size)


def _check_integer_bounds(schema) -> None:
    """UsageError for an integer's bound outside int64: llguidance would clamp it and answer
    9223372036854775807 for a minimum of 1e300 (a value that breaks the schema)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, dict):
            kinds = node.get("type")
            if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
                for bound in _BOUNDS:
                    value = node.get(bound)
                    if isinstance(value, (int, float)) and not isinstance(value, bool) \
                            and not INT64[0] <= value <= INT64[1]:
                        raise UsageError(f"the JSON schema's integer {bound} {value:g} is outside what it can "
                                         f"enforce ({INT64[0]} to {INT64[1]})")
            stack += node.values()


def _satisfiable(matcher) -> bool:
    """Whether anything can follow the start state: some token allowed, or the value
    already complete. A schema that only refers to itself compiles, then fails at the first
    mask; this asks for that mask now, on a copy."""
    probe = matcher.deep_copy()
    mask = probe.compute_bitmask()
    if probe.is_error():
        return False
    return probe.is_accepting() or any(mask)


# Keywords whose values are schemas, or lists or maps of schemas (`closed_objects` walks them).
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema, close: bool = True):
    """The schema with every object that lists its `properties` and says nothing of others
    closed to them (`additionalProperties: false`), as vLLM's default (xgrammar's strict
    mode) and llama.cpp's grammar read such a schema, and as OpenAI's structured outputs
    require it: Pydantic's schemas (instructor's, pydantic-ai's) say nothing, and an open
    object lets a model add keys, and repeat an added key (a grammar cannot keep apart
    keys it does not know; the listed ones come once each, in order). A schema that allows
    more (`additionalProperties`, `patternProperties`, `unevaluatedProperties`) keeps it,
    and so do the parts of an `allOf` (`close` false), which describe one object together."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, close=False) for s in out["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    elif (close and isinstance(out.get("properties"), dict) and "additionalProperties" not in out
          and "patternProperties" not in out and "unevaluatedProperties" not in out and "allOf" not in out):
        out["additionalProperties"] = False
    return out


def _one_line(message) -> str:
    """llguidance's message on one line, its state dump left out and cut short: what a
    client sees must not echo a schema of megabytes back."""
    text = str(message).split("\n<state>")[0]
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"


class Matcher:
    """One request's grammar state (see the module docstring). Token ids only."""

    def __init__(self, llm, width: int, eos_ids: Iterable[int] = ()):
        self.llm = llm
        self.width = width  # the tokenizer's ids; wider logits (padding) are never allowed
        self.eos_ids = frozenset(t for t in eos_ids if t < width)
        self.ahead: list[int] = []  # consumed beyond the committed tokens
        self.masks: dict[tuple[int, ...], mx.array] = {}  # path -> mask, this round
        import numpy as np  # lazily: the CLI starts without it

        # llguidance fills exactly one bit per id of its tokenizer, in whole 32-bit words
        self._bits = np.zeros((width + 31) // 32, dtype=np.int32)

    # --- the committed state ---------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        self._walk(())
        return self.llm.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing but EOS can follow: the value is complete."""
        self._walk(())
        return self.llm.is_stopped()

    def commit(self, tokens: Sequence[int]) -> None:
        """The round committed `tokens` (an EOS among them ends the value: not consumed)."""
        self._walk([t for t in tokens if t not in self.eos_ids])
        self.ahead, self.masks = [], {}

    def until_complete(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` cut after the one that ends the value (an EOS, or the token after which
        nothing may follow), so a block that completes the value commits no more."""
        for i, t in enumerate(tokens):
            if t in self.eos_ids or not self.continues(tokens[: i + 1]):
                return list(tokens[: i + 1])
        return list(tokens)

    # --- along a draft path ----------------------------------------------------------------

    def valid_prefix(self, path: Sequence[int]) -> int:
        """How many leading tokens of `path` the grammar admits. An EOS ends the count, and
        counts itself where the mask allows it (the value may end there): a drafted EOS is
        judged by the target like any other draft token."""
        self._walk(())
        cut = next((i for i, t in enumerate(path) if t in self.eos_ids or t >= self.width), len(path))
        n = self.llm.validate_tokens(list(path[:cut]))
        if n == cut < len(path) and path[cut] in self.eos_ids and self.mask_after(path[:cut])[path[cut]].item():
            n += 1
        return n

    def continues(self, path: Sequence[int]) -> bool:
        """Whether anything but EOS may follow `path` (a valid path)."""
        if path and path[-1] in self.eos_ids:
            return False
        self._walk(path)
        return not self.llm.is_stopped()

    def forced(self, path: Sequence[int], limit: int) -> list[int]:
        """The tokens the grammar forces after `path` (at most `limit`): free drafts."""
        if limit <= 0:
            return []
        self._walk(path)
        return self.llm.compute_ff_tokens()[:limit]

    def mask_after(self, path: Sequence[int]) -> mx.array:
        """bool [width]: the tokens allowed after the committed ones and `path`."""
        key = tuple(path)
        mask = self.masks.get(key)
        if mask is None:
            self._walk(key)
            self.llm.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            import numpy as np  # imported already, by __init__

            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.width]
            if self.eos_ids:  # EOS where the value may end, and where nothing else may come
                bits[list(self.eos_ids)] = self.llm.is_accepting() or not bits.any()
            mask = self.masks[key] = mx.array(bits.astype(np.bool_))
        return mask

    def path_masks(self, path: Sequence[int]) -> mx.array:
        """bool [len(path) + 1, width]: row i after path[:i], the verify block's rows. The
        row after an EOS (a draft's last token) repeats the one before: the round ends at
        the EOS, so it is never used, and the matcher cannot walk past an EOS."""
        ends = len(path) - 1 if path and path[-1] in self.eos_ids else len(path)
        rows = [self.mask_after(path[:i]) for i in range(ends + 1)]
        return mx.stack(rows + rows[-1:] * (len(path) - ends))

    def _walk(self, path: Sequence[int]) -> None:
        """Put the matcher at committed + `path`, reusing what it already walked."""
        path = list(path)
        common = common_prefix_length(self.ahead, path)
        if common < len(self.ahead):
            self.llm.rollback(len(self.ahead) - common)
            del self.ahead[common:]
        rest = path[common:]
        if rest:
            if not self.llm.consume_tokens(rest):
                raise MlxSpecError(f"a draft path left the grammar: {_one_line(self.llm.get_error())}")
            self.ahead += rest


def constrain(logits: mx.array, masks: Optional[mx.array]) -> mx.array:
    """logits [rows, w] with the tokens `masks` ([rows, W] bool) forbids set to -inf; ids
    past W (a padded vocabulary) are forbidden, mask columns past w (a narrower draft) unused."""
    if masks is None:
        return logits
    w, W = logits.shape[-1], masks.shape[-1]
    masks = masks[:, :w] if W >= w else mx.pad(masks, [(0, 0), (0, w - W)])
    return mx.where(masks, logits, mx.array(-mx.inf, logits.dtype))


def read_grammar_option(value: str, kind: str) -> str:
    """A --json-schema / --grammar value: a file's text when it names a file, else itself
    (a JSON schema given inline)."""
    path = Path(value).expanduser()
    if kind == "lark" or (len(value) < 4096 and path.is_file()):
        try:
            return path.read_text()
        except OSError as e:
            raise UsageError(f"cannot read {value}: {e.strerror}") from None
    return value
