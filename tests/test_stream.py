"""The text layer: detokenized streaming, stop strings across round boundaries, draft flags."""

import pytest
from mlx_lm import load

from mlx_spec.drafters import ModelDrafter
from mlx_spec.engine import Engine
from mlx_spec.models.tiny import TINY_VOCAB, perturbed_copy, save_tiny_model
from mlx_spec.stream import _StopText, generate, stream_generate


def test_stop_text_holds_back_a_possible_stop_and_cuts_at_it():
    stops = _StopText(["END"])
    assert stops.push("abcE", [False] * 4) == ("abc", [False] * 3, False)  # "E" may start END
    assert stops.push("N", [True]) == ("", [], False)
    text, flags, stopped = stops.push("Dxyz", [True] * 4)
    assert (text, stopped) == ("", True)  # "EN" + "D": the stop string itself is never released
    stops = _StopText(["END"])
    assert stops.push("aEb", [True, False, True]) == ("aEb", [True, False, True], False)
    assert stops.flush() == ("", [])


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    model, tokenizer = load(str(save_tiny_model(tmp_path_factory.mktemp("tiny"))))
    return model, tokenizer


def test_streamed_text_equals_decoded_tokens(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    engine = Engine(model, ModelDrafter(perturbed_copy(model, 0.02), TINY_VOCAB), eos_ids=tokenizer.eos_token_ids)
    responses = list(stream_generate(engine, tokenizer, "hello", gamma=3, max_tokens=40))
    text = "".join(r.text for r in responses)
    tokens = [t for r in responses for t in r.round.tokens]
    assert text == tokenizer.decode([t for t in tokens if t not in engine.eos_ids])
    assert all(len(r.from_draft) == len(r.text) for r in responses)
    assert any(flag for r in responses for flag in r.from_draft)  # accepted drafts are marked
    assert responses[-1].finish_reason in ("stop", "length")


def test_stop_string_ends_generation_without_it(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    engine = Engine(model, ModelDrafter(perturbed_copy(model, 0.02), TINY_VOCAB))
    full = generate(engine, tokenizer, "hello", gamma=3, max_tokens=40).text
    stop = full[15:18]
    cut = generate(engine, tokenizer, "hello", gamma=3, max_tokens=40, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)]
