"""Structured output stays exact under speculation (issue 34).

References outside our code: greedy constrained decoding is mlx-lm's own `generate_step`
with a logits processor that applies a separate llguidance matcher's mask (no part of
`mlx_spec.core.grammar`); the sampled test computes the masked distribution by hand from the
tokens the regex allows and checks draws against it (chi-square), and shows that a rule
judging drafts against the unmasked p fails the same check.
"""

import json
from pathlib import Path

import jsonschema
import mlx.core as mx
import pytest
from distribution_support import chi_square
from grammar_support import (  # noqa: F401
    ADDRESS,
    EOS,
    PROMPT,
    TOKENIZER,
    constrained_reference,
    encode,  # noqa: F401
)

import mlx_spec.core.engine as engine_module
import mlx_spec.core.verify as verify_module
from mlx_spec.core.engine import Engine
from mlx_spec.core.grammar import compile_grammar, constrain
from mlx_spec.core.sampling import LogitProcessor, SamplingParams, draw
from mlx_spec.core.stats import Stats
from mlx_spec.core.verify import Verdict, accepted_prefix
from mlx_spec.drafters import ModelDrafter, NgramDrafter
from mlx_spec.errors import UsageError
from mlx_spec.testing.tiny import (
    TINY_VOCAB,
    perturbed_copy,
    tiny_gemma3,
)


def run(engine, schema, gamma, max_tokens=90, params=SamplingParams(), prompt=PROMPT, raw=False):
    grammar = compile_grammar(TOKENIZER, "json_schema", schema, EOS).matcher(EOS)
    stats = Stats()
    rounds = list(engine.rounds(prompt, params, gamma=gamma, max_tokens=max_tokens, stats=stats,
                                constraint=grammar))
    tokens = [t for r in rounds for t in r.tokens]
    return [t for t in tokens if t not in EOS or raw], rounds[-1].finish_reason, stats


@pytest.fixture(scope="module")
def target():
    return tiny_gemma3(seed=0)


@pytest.fixture(scope="module")
def reference(target):
    return constrained_reference(target, PROMPT, ADDRESS, 90)


def test_the_reference_is_a_valid_address(reference):
    value = json.loads(TOKENIZER.decode(reference))
    assert set(value) == {"street", "city", "postal_code", "country"}


@pytest.mark.parametrize("drafter,gamma", [("none", 0), ("ngram", 1), ("ngram", 3), ("model", 2), ("model", 5)])
def test_greedy_constrained_output_is_plain_constrained_decoding(target, reference, drafter, gamma):
    make = {"none": lambda: None, "ngram": NgramDrafter,
            "model": lambda: ModelDrafter(perturbed_copy(target, noise=0.02, seed=1), TINY_VOCAB)}
    engine = Engine(target, make[drafter](), eos_ids=EOS)
    tokens, finish, stats = run(engine, ADDRESS, gamma, raw=True)
    assert tokens == reference and finish == "stop"  # no EOS after the complete value, as plain decoding
    assert stats.grammar_forced > 10  # key names, '": "', '", "' came free
    if gamma:
        assert stats.drafted > 0


def test_our_plain_path_without_forced_drafts_is_the_reference(target, reference):
    engine = Engine(target)
    engine.grammar_drafts = False
    tokens, _, stats = run(engine, ADDRESS, 0)
    assert tokens == reference and stats.grammar_forced == 0 and stats.rounds == len(reference)
    drafting = Engine(target, NgramDrafter())  # the drafter's tokens alone, still verified
    drafting.grammar_drafts = False
    tokens, _, stats = run(drafting, ADDRESS, 3)
    assert tokens == reference and stats.grammar_forced == 0 and stats.accepted > 0


def test_mtp_drafter_under_a_grammar(tmp_path):
    from mlx_spec.apps.runner import build_engine
    from mlx_spec.loading.pairing import load_pair
    from mlx_spec.testing.tiny_gemma4 import save_tiny_assistant, save_tiny_gemma4

    save_tiny_gemma4(tmp_path / "target")
    save_tiny_assistant(tmp_path / "assistant")
    pair = load_pair(str(tmp_path / "target"), str(tmp_path / "assistant"), dtype="float32", progress=False)
    engine = build_engine(pair)
    grammar = compile_grammar(pair.tokenizer, "json_schema", ADDRESS, engine.eos_ids)
    prompt = pair.tokenizer.encode('Address: {"street": "1 Elm", "city": "Oslo"} Another: ')
    schema_ref = constrained_reference_for(pair, prompt, 50)
    for gamma in (2, 4):
        stats = Stats()
        tokens = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=50, stats=stats,
                                           constraint=grammar.matcher(engine.eos_ids)) for t in r.tokens]
        assert [t for t in tokens if t not in engine.eos_ids] == schema_ref
        assert stats.drafted > 0


def constrained_reference_for(pair, prompt, max_tokens):
    plain = Engine(pair.target.model, eos_ids=pair.tokenizer.eos_token_ids)
    plain.grammar_drafts = False
    grammar = compile_grammar(pair.tokenizer, "json_schema", ADDRESS, plain.eos_ids)
    tokens = [t for r in plain.rounds(prompt, gamma=0, max_tokens=max_tokens,
                                      constraint=grammar.matcher(plain.eos_ids))
              for t in r.tokens]
    return [t for t in tokens if t not in plain.eos_ids]


# --- temperature 1: the masked distribution, exactly ---------------------------------------

REGEX = "[a-f]xyz[a-f]{1,3}"  # tokens 2-4 forced: drafted free after the drafter's token
ALLOWED = encode("abcdef")
PARAMS = dict(temperature=1.0, top_k=4, top_p=0.9, repetition_penalty=1.3, repetition_context=4)
SAMPLE_PROMPT = [2] + encode("abxyzc cexyzd")
DRAWS = 250


def masked_joint(target, params):
    """P(t1, t5) under plain sampling of the masked target: t1 and t5 among a-f, t2-4 forced."""
    processor = LogitProcessor(params)
    allowed = mx.zeros((TINY_VOCAB,), mx.bool_).at[mx.array(ALLOWED)].add(True)

    def p_next(ids):
        logits = mx.where(allowed, target(mx.array(ids)[None])[0, -1:], -mx.inf)
        return processor.distribution(logits, processor.windows(ids, None, 1))[0].tolist()

    p1 = p_next(SAMPLE_PROMPT)
    return {(a, b): p1[a] * pb for a in ALLOWED if p1[a] > 0
            for b, pb in enumerate(p_next(SAMPLE_PROMPT + [a] + encode("xyz"))) if pb > 0}


def sampled_joint(engine, params, gamma, draws, forced_drafts=True):
    grammar = compile_grammar(TOKENIZER, "regex", REGEX, EOS)
    cache, counts, forced = engine.make_prompt_cache(), {}, 0
    for seed in range(draws):
        stats = Stats()
        run_params = SamplingParams(**{**params.__dict__, "seed": seed})
        tokens = [t for r in engine.rounds(SAMPLE_PROMPT, run_params, gamma=gamma, max_tokens=6, stats=stats,
                                           prompt_cache=cache, constraint=grammar.matcher(EOS))
                  for t in r.tokens]
        assert tokens[1:4] == encode("xyz")
        counts[(tokens[0], tokens[4])] = counts.get((tokens[0], tokens[4]), 0) + 1
        forced += stats.grammar_forced
    assert forced > 0 or not forced_drafts
    return counts


@pytest.fixture(scope="module")
def sampling_models():
    return tiny_gemma3(seed=0, logit_scale=2.0), tiny_gemma3(seed=9, logit_scale=2.0)  # unrelated: rejections


@pytest.mark.parametrize("drafter", ["model", pytest.param("ngram", marks=pytest.mark.slow)])
def test_sampling_under_a_grammar_is_the_masked_distribution(sampling_models, drafter):
    target, draft = sampling_models
    params = SamplingParams(**PARAMS)
    engine = Engine(target, ModelDrafter(draft, TINY_VOCAB) if drafter == "model" else NgramDrafter(min_ngram=1))
    stat, critical = chi_square(sampled_joint(engine, params, 2, DRAWS), masked_joint(target, params))
    assert stat < critical


def test_judging_drafts_against_unmasked_p_fails_the_check(sampling_models, monkeypatch):
    """The broken rule accepts x_i with p(x_i)/q(x_i) of the target's unmasked p; the recovered
    and bonus tokens still come from the masked p, so every output is valid, but biased."""
    target, draft = sampling_models
    params = SamplingParams(**{**PARAMS, "repetition_penalty": 1.0})
    processor, masked = LogitProcessor(params), {}

    def keep_unmasked(logits, block_masks):
        masked["p"] = processor.distribution(constrain(logits, block_masks))
        return logits

    def unmasked_acceptance(x, q, p, key):
        key_accept, key_token = mx.random.split(key)
        gamma, V, p_masked = x.shape[0], p.shape[-1], masked["p"]
        q = (mx.arange(V)[None, :] == x[:, None]).astype(p.dtype) if q is None else q
        p_x = mx.take_along_axis(p[:gamma], x[:, None].astype(mx.int32), axis=-1)[:, 0]
        q_x = mx.take_along_axis(q, x[:, None].astype(mx.int32), axis=-1)[:, 0]
        n = accepted_prefix(mx.random.uniform(shape=(gamma,), key=key_accept) * q_x < p_x)
        q_n = mx.take(mx.concatenate([q, mx.zeros((1, V))]), n, axis=0)
        residual = mx.maximum(mx.take(p_masked, n, axis=0) - q_n, 0)
        final = mx.where(residual.sum() > 0, residual / residual.sum(), mx.take(p_masked, n, axis=0))
        return Verdict(n, draw(final, key_token))

    monkeypatch.setattr(engine_module, "constrain", keep_unmasked)
    monkeypatch.setattr(verify_module, "verify_sampled", unmasked_acceptance)
    engine = Engine(target, ModelDrafter(draft, TINY_VOCAB))
    stat, critical = chi_square(sampled_joint(engine, params, 2, 40, forced_drafts=False), masked_joint(target, params))
    assert stat > critical


# --- failures are never silent -------------------------------------------------------------

def test_a_cut_value_says_length(target):
    tokens, finish, _ = run(Engine(target, NgramDrafter()), ADDRESS, 3, max_tokens=8)
    assert finish == "length" and len(tokens) == 8


@pytest.mark.parametrize("kind,source,named", [
    ("json_schema", {"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "[a-", "unclosed character class"),
    ("lark", "start: missing_rule", "missing_rule"),
])
def test_an_unusable_grammar_is_a_one_line_error_naming_it(kind, source, named):
    with pytest.raises(UsageError) as error:
        compile_grammar(TOKENIZER, kind, source)
    assert named in str(error.value) and "\n" not in str(error.value)


# --- many schemas: every finished output validates ---------------------------------------

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "schemas.json").read_text())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_finished_output_validates(target, temperature):
    """34 schemas (nested objects, bounded arrays, enum, const, pattern, anyOf / oneOf / allOf,
    $ref, formats, additionalProperties false) on the tiny random model: greedy with n-gram
    drafts, sampled with a draft model; each finished value must validate with jsonschema."""
    drafter = NgramDrafter() if temperature == 0 else ModelDrafter(perturbed_copy(target, noise=0.02, seed=1),
                                                                  TINY_VOCAB)
    engine, finished = Engine(target, drafter), 0
    for i, schema in enumerate(SCHEMAS):
        params = SamplingParams(temperature=temperature, top_p=0.95, seed=i)
        tokens, finish, _ = run(engine, schema, 3, max_tokens=80, params=params, prompt=PROMPT[:20])
        if finish == "stop":
            jsonschema.validate(json.loads(TOKENIZER.decode(tokens)), schema)
            finished += 1
    assert finished >= 0.8 * len(SCHEMAS)


# --- the real tokenizer and model (slow) ---------------------------------------------------

@pytest.mark.slow
def test_real_gemma_constrained_greedy_is_plain_constrained_decoding(gemma270m):
    """The embedded Gemma 3 270M with its 262,144-token tokenizer, a prompt past the 512-token
    window: n-gram drafts and forced runs give plain constrained decoding's tokens."""
    tokenizer, model = gemma270m.tokenizer, gemma270m.model
    eos = set(tokenizer.eos_token_ids)
    record = '{"name": "Anna Schmidt", "street": "12 Lindenstrasse", "city": "Berlin", "postal_code": "10115"}\n'
    prompt = list(tokenizer.encode("Customer records, one JSON object per line:\n" + record * 24))
    assert len(prompt) > 512
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 30} for k in
                                                ("name", "street", "city", "postal_code")},
              "required": ["name", "street", "city", "postal_code"], "additionalProperties": False}
    grammar = compile_grammar(tokenizer, "json_schema", schema, eos)
    plain = Engine(model, eos_ids=eos)
    plain.grammar_drafts = False
    outputs = {}
    for name, engine, gamma in (("plain", plain, 0), ("ngram", Engine(model, NgramDrafter(), eos_ids=eos), 4)):
        stats = Stats()
        outputs[name] = [t for r in engine.rounds(prompt, gamma=gamma, max_tokens=60, stats=stats,
                                                  constraint=grammar.matcher(eos)) for t in r.tokens]
    assert outputs["ngram"] == outputs["plain"]
    assert stats.grammar_forced > 0 and stats.accepted > 0
    jsonschema.validate(json.loads(tokenizer.decode([t for t in outputs["plain"] if t not in eos])), schema)
