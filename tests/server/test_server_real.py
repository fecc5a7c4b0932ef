"""`mlx-spec serve` on the embedded Gemma 3 270M (slow: real weights on a CPU): the default
preset's model and n-gram drafter with γ forced to 3 (`auto` never drafts for this float32
model on a CPU, and drafting is what must stay exact), through the official openai client,
against mlx-lm's own greedy `generate`."""

import pytest
from mlx_lm import generate
from server_support import serving

pytestmark = pytest.mark.slow

PROMPT = "The three most useful habits for a new programmer are"


@pytest.fixture(scope="module")
def server(gemma270m):
    """The default preset with γ 3. `gemma270m` has imported the GGUF into this session's
    MLX_SPEC_CACHE, which the server process inherits."""
    yield from serving(["--gamma", "3"], timeout=240)


def mlx_lm_tokenizer(loaded):
    """mlx-lm's own tokenizer for the reference: a GGUF import loads a `FastTokenizer`,
    whose `full` is mlx-lm's `TokenizerWrapper` for the same folder."""
    return getattr(loaded.tokenizer, "full", loaded.tokenizer)


def test_completion_equals_mlx_lm(server, gemma270m):
    """(Equality with `mlx-spec generate` is tested on tiny models; a second load of the
    real model here would double this test's time.)"""
    client = server.client(timeout=120)
    assert [m.id for m in client.models.list().data] == ["default"]
    answer = client.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
    ids = gemma270m.tokenizer.encode(PROMPT)
    reference = generate(gemma270m.model, mlx_lm_tokenizer(gemma270m), ids, max_tokens=12)
    assert answer.choices[0].text == reference
    assert answer.usage.completion_tokens == 12
    stats = answer.model_extra["mlx_spec"]
    assert stats["drafter"] == "suffix" and stats["gamma"] == "3"


def test_chat_second_turn_reuses_the_first(server, gemma270m):
    """Turn 2 (streamed) prefills only what follows turn 1's prompt, and still answers
    exactly as mlx-lm does from scratch."""
    client = server.client(timeout=120)
    tokenizer = mlx_lm_tokenizer(gemma270m)
    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="default", messages=turn1, max_tokens=8,
                                           temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And of Italy?"}]
    chunks = list(client.chat.completions.create(
        model="default", messages=turn2, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    p1 = list(tokenizer.apply_chat_template(turn1, add_generation_prompt=True))
    p2 = list(tokenizer.apply_chat_template(turn2, add_generation_prompt=True))
    usage, stats = chunks[-1].usage, chunks[-1].model_extra["mlx_spec"]
    assert usage.prompt_tokens == len(p2)
    assert usage.prompt_tokens_details.cached_tokens >= len(p1)
    assert stats["prefill_tokens_target"] == len(p2) - 1 - usage.prompt_tokens_details.cached_tokens
    assert text == generate(gemma270m.model, tokenizer, p2, max_tokens=8)
    assert stats["drafted"] > 0  # the n-gram drafter found the conversation repeating itself


def test_logprobs_of_drafted_tokens_equal_mlx_lm(server, gemma270m):
    """A copying prompt, so the n-gram drafter's tokens are accepted: their log-probs (and
    the top alternatives) are the target's, as mlx-lm's plain `generate_step` reports them."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    client = server.client(timeout=120)
    prompt = "one two three four five six seven eight. one two three four five six seven eight. one two"
    answer = client.completions.create(model="default", prompt=prompt, max_tokens=10, temperature=0,
                                       logprobs=3)
    assert answer.model_extra["mlx_spec"]["accepted"] > 0
    got = answer.choices[0].logprobs
    ids = gemma270m.tokenizer.encode(prompt)
    steps = generate_step(mx.array(ids), gemma270m.model, max_tokens=len(got.tokens))
    for i, (token, logprobs) in enumerate(steps):
        assert abs(got.token_logprobs[i] - logprobs[int(token)].item()) < 1e-3
        top = sorted(logprobs.tolist(), reverse=True)[:3]
        assert sorted(got.top_logprobs[i].values(), reverse=True) == pytest.approx(top, abs=1e-3)


def test_logprobs_of_byte_tokens_on_the_real_vocabulary(server, gemma270m):
    """Gemma's vocabulary spells a llama emoji in four byte tokens (<0xF0> <0x9F> <0xA6>
    <0x99>), each decoding to U+FFFD alone: completions' top 20 keep them apart (they
    collapsed to 1-3 keys), the chosen token is under its own label, and chat's bytes join
    into the answer's text."""
    client = server.client(timeout=120)
    answer = client.completions.create(model="default", prompt="Emoji for joy: 😂😂😂 and for a llama: 🦙🦙",
                                       max_tokens=8, temperature=0, logprobs=20)
    got, text = answer.choices[0].logprobs, answer.choices[0].text
    assert "🦙" in text and "bytes:\\xf0" in got.tokens and len(got.tokens) == answer.usage.completion_tokens
    for token, logprob, top in zip(got.tokens, got.token_logprobs, got.top_logprobs):
        assert len(top) == 20 and top[token] == logprob
    for token, offset in zip(got.tokens, got.text_offset):
        assert token.startswith("bytes:") or text[offset:].startswith(token)
    chat = client.chat.completions.create(
        model="default", max_tokens=16, temperature=0, logprobs=True, top_logprobs=20,
        messages=[{"role": "user", "content": "Repeat exactly: 🦙🦙🦙"}])
    content, text = chat.choices[0].logprobs.content, chat.choices[0].message.content
    assert "🦙" in text
    assert bytes(b for entry in content for b in entry.bytes).decode("utf-8") == text
    assert len(content) == chat.usage.completion_tokens
    assert all(len({alt.token for alt in entry.top_logprobs}) == 20 for entry in content)


def test_anthropic_messages_equal_mlx_lm(server, gemma270m):
    import anthropic

    tokenizer = mlx_lm_tokenizer(gemma270m)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    message = client.messages.create(model="default", max_tokens=8, messages=messages,
                                     extra_body={"temperature": 0})
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert message.content[0].text == generate(gemma270m.model, tokenizer, ids, max_tokens=8)
