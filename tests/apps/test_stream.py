"""The text layer: detokenized streaming, stop strings across round boundaries, draft flags."""

import pytest
from mlx_lm import load

from mlx_spec.apps.stream import _StopText, generate, stream_generate
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.drafters import ModelDrafter
from mlx_spec.testing.tiny import TINY_VOCAB, perturbed_copy, save_tiny_model


def test_stop_text_holds_back_a_possible_stop_and_cuts_at_it():
    def push(stops, pieces, flag):  # one token per piece, ids 100, 101, ...
        for piece in pieces:
            stops.add(100 + len(stops.text), piece, [flag] * len(piece))
        return stops.release()

    stops = _StopText(["END"])
    assert push(stops, ["ab", "cE"], False) == ("abc", [False] * 3, [100], False)  # "E" may start END
    assert push(stops, ["N"], True) == ("", [], [], False)
    text, flags, tokens, stopped = push(stops, ["Dx", "yz"], True)
    assert (text, tokens, stopped) == ("", [], True)  # "EN" + "D": the stop string is never released
    assert stops.dropped == 4  # "cE", "N", "Dx" and "yz" are not kept
    stops = _StopText(["END"])
    assert push(stops, ["aEb"], True) == ("aEb", [True] * 3, [100], False)
    stops.add(200, "", [])  # an EOS: no text, released at the end
    assert stops.release(final=True) == ("", [], [200], False)


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


@pytest.fixture(scope="module")
def ascii_tiny(tmp_path_factory):
    """A tiny model that writes printable ASCII only (the embedding rows of every other
    token are zero, so their logits are 0 and lose to some printable token's), so its text
    tokenizes back to the same ids: a fair reference for what a chat turn shows."""
    import mlx.core as mx

    model, tokenizer = load(str(save_tiny_model(tmp_path_factory.mktemp("ascii"))))
    printable = [i for i in range(TINY_VOCAB) if len(text := tokenizer.decode([i])) == 1 and " " <= text <= "~"]
    mask = mx.zeros((TINY_VOCAB, 1)).at[mx.array(printable)].add(1.0)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * mask
    return model, tokenizer


def test_stop_string_result_counts_only_what_was_shown(ascii_tiny):
    model, tokenizer = ascii_tiny
    engine = Engine(model, ModelDrafter(perturbed_copy(model, 0.02), TINY_VOCAB))
    full = generate(engine, tokenizer, "hello", gamma=3, max_tokens=40)
    stop = full.text[15:18]
    cut = generate(engine, tokenizer, "hello", gamma=3, max_tokens=40, stop=[stop])
    assert cut.text == full.text[: full.text.find(stop)]
    # the tokens kept are those whose text was shown: no token of the stop string or after it
    # (a stop string can begin inside a token's text: that token is not kept)
    assert tokenizer.decode(cut.tokens) == cut.text  # not the stop string, nor what followed
    assert cut.tokens == full.tokens[: len(cut.tokens)]
    assert cut.stats.generated == len(cut.tokens) < len(full.tokens)


def test_chat_turn_after_a_stop_string_continues_from_what_was_shown(ascii_tiny):
    """The next turn's context is exactly the conversation as shown: the answer cut before
    the stop string. Reference: the whole conversation rendered and tokenized afresh, then
    decoded greedily by mlx-lm."""
    from conftest import greedy_reference

    from mlx_spec.apps.conversation import ChatSession

    model, tokenizer = ascii_tiny
    engine = Engine(model, ModelDrafter(perturbed_copy(model, 0.02), TINY_VOCAB), eos_ids=tokenizer.eos_token_ids)
    answer = "".join(r.text for r in ChatSession(engine, tokenizer).ask("hi", SamplingParams(), gamma=3, max_tokens=30))
    stop = answer[12:14]
    session = ChatSession(engine, tokenizer)
    shown = "".join(r.text for r in session.ask("hi", SamplingParams(), gamma=3, max_tokens=30, stop=[stop]))
    assert shown == answer[: answer.find(stop)]
    assert session.messages[-1] == {"role": "assistant", "content": shown}
    messages = session.messages + [{"role": "user", "content": "and then?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    fresh = list(tokenizer.encode(text, add_special_tokens=False))
    second = [t for r in session.ask("and then?", SamplingParams(), gamma=3, max_tokens=20) for t in r.round.tokens]
    assert session.ids[: len(fresh)] == fresh
    assert second == greedy_reference(model, fresh, 20)[: len(second)]
    assert session.cache.target.ids == (fresh + second)[:-1]  # nothing after the stop string


def test_open_prefix_equals_a_brute_force_search():
    """The stop matcher's held-back tail, against the definition: the longest end of the
    text that is a proper prefix of the stop string."""
    import random

    from mlx_spec.apps.stream import _open_prefix

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
        stop = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 8)))
        expected = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        assert _open_prefix(text, stop) == expected, (text, stop)


def test_many_long_stop_strings_cost_the_matcher_little_per_round():
    """Holding back text looks only at the tail that can still grow into a stop string, and
    only where one could start: 300 stop strings of 3,000 characters over 20 rounds take
    well under a second (re-checking every prefix of each, as before, took seconds; the
    server also bounds them, see test_server_hardening)."""
    import time

    stops = _StopText([f"{i:03d}" + "q" * 2997 for i in range(300)])
    piece = "some words " * 300
    started = time.perf_counter()
    for i in range(20):
        stops.add(100 + i, piece, [False] * len(piece))
        text, _, _, stopped = stops.release()
        assert text == piece and not stopped
    assert time.perf_counter() - started < 0.5
