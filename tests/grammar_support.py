"""Shared by several test modules; moved from test_grammar.py."""

import json

import llguidance
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from tokenizers import Tokenizer

from mlx_spec.core.grammar import JSON_OPTIONS
from mlx_spec.testing.tiny import (
    END_OF_TURN_ID,
    EOS_ID,
    byte_tokenizer_json,
)

EOS = (EOS_ID, END_OF_TURN_ID)


TOKENIZER = Tokenizer.from_str(json.dumps(byte_tokenizer_json()))


ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string", "pattern": "^[0-9]{1,3} [A-Z][a-z]{1,6} (St|Rd)$"},
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
    "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
    "country": {"enum": ["US", "DE", "FR"]}},
    "required": ["street", "city", "postal_code", "country"], "additionalProperties": False}


def encode(text):
    return TOKENIZER.encode(text, add_special_tokens=False).ids


PROMPT = [2] + encode('Address: {"street": "12 Oak Rd", "city": "Leeds", "postal_code": "12345", '
                      '"country": "FR"}\nAnother: ')  # 90 tokens: past the window of 16


def constrained_reference(model, prompt, schema, max_tokens):
    """mlx-lm's greedy generate_step, its logits masked by llguidance directly; the tokens
    up to the value's end (an EOS, or the token that completed it)."""
    tokenizer = llguidance.LLTokenizer(TOKENIZER.to_str(), eos_token=list(EOS))
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults=JSON_OPTIONS))
    seen = len(prompt)

    def mask(tokens, logits):
        nonlocal seen
        for t in tokens.tolist()[seen:]:
            assert matcher.consume_token(t)
        seen = tokens.shape[0]
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.zeros(logits.shape[-1], bool)
        allowed[: min(len(bits), allowed.size)] = bits[: allowed.size].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)

    out, ends = [], matcher.deep_copy()  # `ends` follows the tokens yielded, to stop at the value's end
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[mask]):
        if token in EOS:
            break
        out.append(token)
        assert ends.consume_token(token)
        if ends.is_stopped():
            break
    return out




def drafted_under_the_address_schema(target, drafter, gamma=5, max_tokens=60):
    """Greedy decoding of PROMPT under the ADDRESS schema with `drafter`: the tokens (EOS
    left out), what the target alone decodes under it (`constrained_reference`), and the
    tokens drafted."""
    from mlx_spec.core.engine import Engine
    from mlx_spec.core.grammar import compile_grammar
    from mlx_spec.core.stats import Stats

    engine = Engine(target, drafter, eos_ids=EOS)
    grammar = compile_grammar(TOKENIZER, "json_schema", ADDRESS, EOS).matcher(EOS)
    stats = Stats()
    tokens = [t for r in engine.rounds(PROMPT, gamma=gamma, max_tokens=max_tokens, stats=stats, constraint=grammar)
              for t in r.tokens]
    reference = constrained_reference(target, PROMPT, ADDRESS, max_tokens)
    return [t for t in tokens if t not in EOS], reference, stats.drafted
