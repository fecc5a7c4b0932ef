"""`mlx-spec serve` for agents and editors (issue 19), on tiny models through the official
`openai` client: message content as parts, the target's log-probs (checked against mlx-lm's
own `generate_step`), tool calls."""

import math

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_repetition_penalty

from server_support import assert_openai_error, server_env, serving

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")


@pytest.fixture(scope="module")
def spec_server(tiny_dirs, cost_cache):
    target, draft = tiny_dirs
    yield from serving(["--model", target, "--draft-model", draft, "--gamma", "3"], server_env(cost_cache))


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """mlx-lm's model and tokenizer for the target, loaded independently of mlx-spec."""
    return load(tiny_dirs[0])


def mlx_lm_logprobs(model, prompt_ids, n):
    """(token, its log-prob, the vector of log-probs) for n greedy steps of mlx-lm."""
    out = []
    for token, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=n):
        out.append((int(token), logprobs))
    return out


def test_content_as_text_parts(spec_server, tiny_dirs):
    client = spec_server.client()
    ask = dict(model=tiny_dirs[0], max_tokens=8, temperature=0)
    plain = client.chat.completions.create(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], **ask)
    parts = client.chat.completions.create(
        messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                               {"type": "text", "text": "there"}]}], **ask)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    response = spec_server.post("/chat/completions", {
        "model": tiny_dirs[0], "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]})
    error = assert_openai_error(response, 400, "messages[0].content[1]", "image_url", "text only")
    assert error["param"] == "messages[0].content[1]" and error["code"] == "unsupported_content"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(messages=[{"role": "user", "content": [image]}], **ask)


def _assert_close(a, b, tol=2e-4):
    assert abs(a - b) < tol, (a, b)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_targets_for_drafted_tokens_too(stream, spec_server, tiny_dirs, reference):
    model, tokenizer = reference
    messages = [{"role": "user", "content": "Tell me a story about a cat"}]
    n, top = 24, 3
    ask = dict(model=tiny_dirs[0], messages=messages, max_tokens=n, temperature=0, logprobs=True,
               top_logprobs=top)
    if stream:
        chunks = list(spec_server.client().chat.completions.create(**ask, stream=True))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        stats = chunks[-1].model_extra["mlx_spec"]
    else:
        answer = spec_server.client().chat.completions.create(**ask)
        content, text = answer.choices[0].logprobs.content, answer.choices[0].message.content
        stats = answer.model_extra["mlx_spec"]
    assert stats["accepted"] > 0  # some of the tokens scored came from the draft
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    expected = [(t, lp) for t, lp in mlx_lm_logprobs(model, prompt, n)]
    eos = set(tokenizer.eos_token_ids)
    for i, (t, _) in enumerate(expected):
        if t in eos:
            expected = expected[:i]
            break
    assert len(content) == len(expected) > 0
    # each token's own bytes (a byte-level piece: one byte per character), which join back
    # into the answer where decoding tokens one by one gives U+FFFD for split characters
    assert bytes(b for entry in content for b in entry.bytes).decode("utf-8", "replace") == text
    for entry, (token, logprobs) in zip(content, expected):
        assert entry.token == tokenizer.decode([token])
        _assert_close(entry.logprob, logprobs[token].item())
        ids = mx.argsort(-logprobs)[:top].tolist()
        assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([i]) for i in ids]
        for alt, i in zip(entry.top_logprobs, ids):
            _assert_close(alt.logprob, logprobs[i].item())


def test_completion_logprobs_and_checks(spec_server, tiny_dirs, reference):
    model, tokenizer = reference
    client = spec_server.client()
    prompt = "Hello there, how"
    answer = client.completions.create(model=tiny_dirs[0], prompt=prompt, max_tokens=16, temperature=0,
                                       logprobs=2)
    got = answer.choices[0].logprobs
    expected = mlx_lm_logprobs(model, tokenizer.encode(prompt), len(got.tokens))
    assert len(got.tokens) == answer.usage.completion_tokens - (answer.choices[0].finish_reason == "stop")
    for i, (token, logprobs) in enumerate(expected):
        _assert_close(got.token_logprobs[i], logprobs[token].item())
        assert got.tokens[i] == tokenizer.decode([token])
        ids = mx.argsort(-logprobs)[:2].tolist()
        assert sorted(got.top_logprobs[i].values(), reverse=True) == pytest.approx(
            [logprobs[j].item() for j in ids], abs=2e-4)
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]
    assert all(math.isfinite(v) and v <= 0 for v in got.token_logprobs)
    plain = client.completions.create(model=tiny_dirs[0], prompt=prompt, max_tokens=16, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == answer.choices[0].text
    for body, fragment in [({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs")]:
        assert_openai_error(spec_server.post("/completions", {"model": tiny_dirs[0], "prompt": "hi", **body}),
                            400, fragment)
    chat = {"model": tiny_dirs[0], "messages": [{"role": "user", "content": "hi"}]}
    assert_openai_error(spec_server.post("/chat/completions", {**chat, "top_logprobs": 2}), 400,
                        "top_logprobs needs logprobs")
    assert_openai_error(spec_server.post("/chat/completions", {**chat, "logprobs": True, "top_logprobs": 30}),
                        400, "top_logprobs")


def test_tools_on_a_template_without_tool_calls_are_refused(spec_server, tiny_dirs):
    """Gemma 3's template has no tool-call format: tools are refused (as mlx-lm's server and
    Ollama refuse them), unless tool_choice is "none"."""
    tool = {"type": "function", "function": {"name": "get_time"}}
    chat = {"model": tiny_dirs[0], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_openai_error(spec_server.post("/chat/completions", {**chat, "tools": [tool]}), 400,
                        "tools", "no tool-call format")
    assert spec_server.post("/chat/completions", {**chat, "tools": [tool], "tool_choice": "none"}).status_code == 200
    # Issue 32: nor can it show calls and results in the history (its template would drop
    # the calls and write a "<start_of_turn>tool" turn), with or without tools.
    call = {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    history = chat["messages"] + [call, {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    error = assert_openai_error(spec_server.post("/chat/completions", {**chat, "messages": history}), 400,
                                "messages[1].tool_calls", "no tool-call format")
    assert error["param"] == "messages[1].tool_calls"
    results = chat["messages"] + [{"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    assert_openai_error(spec_server.post("/chat/completions", {**chat, "messages": results}), 400,
                        "messages[1].role", "no tool-call format")


def test_logprobs_with_a_repetition_penalty_are_mlx_lms(spec_server, tiny_dirs, reference):
    """Log-probs are taken after the repetition penalty, before temperature and truncation,
    as mlx-lm's `generate_step` reports them after its logits processors: so at temperature
    0 the token chosen is the likeliest one shown. (Before, they were the unpenalized ones.)"""
    model, tokenizer = reference
    prompt, n, penalty = "Hello there, how", 16, 1.5
    answer = spec_server.client().completions.create(
        model=tiny_dirs[0], prompt=prompt, max_tokens=n, temperature=0, logprobs=2,
        extra_body={"repetition_penalty": penalty})
    got = answer.choices[0].logprobs
    # the server's penalty window is 64 tokens (SamplingParams.repetition_context)
    steps = generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=len(got.tokens),
                          logits_processors=[make_repetition_penalty(penalty, 64)])
    expected = [(int(token), logprobs) for token, logprobs in steps]
    assert [tokenizer.decode([t]) for t, _ in expected] == got.tokens
    unpenalized = mlx_lm_logprobs(model, tokenizer.encode(prompt), len(got.tokens))
    assert any(abs(a[1][a[0]].item() - b[1][b[0]].item()) > 1e-2 for a, b in zip(expected, unpenalized))
    for i, (token, logprobs) in enumerate(expected):
        _assert_close(got.token_logprobs[i], logprobs[token].item())
        _assert_close(got.token_logprobs[i], mx.max(logprobs).item())  # greedy took the likeliest
        alternatives = {}
        for j in mx.argsort(-logprobs)[:2].tolist():  # ids that show the same text: the likelier
            alternatives.setdefault(tokenizer.decode([j]), logprobs[j].item())
        assert got.top_logprobs[i] == pytest.approx(alternatives, abs=2e-4)


# A Gemma-style SentencePiece vocabulary with byte fallback (`tiny_gemma4`): ids 6..261 are
# <0x00>..<0xFF>, 270 is "▁the". The scripted answer spells "café the" with é as its two
# UTF-8 bytes, <0xC3> <0xA9>: tokens whose text alone is U+FFFD.
BYTE_TOKEN = 6
CAFE_THE = [BYTE_TOKEN + b for b in b"caf\xc3\xa9"] + [270]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprob_bytes_are_each_tokens_own_bytes(stream, tmp_path):
    """OpenAI's `bytes` exist so that characters split over tokens can be put back together:
    a byte-fallback token's bytes are its one byte, not the UTF-8 of U+FFFD. Checked against
    the SentencePiece vocabulary itself (and the answer's text joins them back)."""
    from mlx_lm.utils import load_tokenizer

    from mlx_spec.engine import Engine
    from mlx_spec.models.tiny_gemma4 import save_sentencepiece_tokenizer
    from mlx_spec.server import ServerOptions, create_app
    from scripted_model import END_OF_TURN_ID, EOS_ID, InProcessServer, ScriptedModel

    save_sentencepiece_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path, eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    pieces = tokenizer.convert_ids_to_tokens(CAFE_THE)
    assert pieces == ["<0x63>", "<0x61>", "<0x66>", "<0xC3>", "<0xA9>", "▁the"]
    model = ScriptedModel()
    model.script = CAFE_THE
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name="scripted", gamma="0",
                                                                          context_length=4096)))
    try:
        ask = dict(model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                   temperature=0, logprobs=True, top_logprobs=1)
        if stream:
            chunks = list(server.client().chat.completions.create(**ask, stream=True))
            entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            answer = server.client().chat.completions.create(**ask)
            entries, text = answer.choices[0].logprobs.content, answer.choices[0].message.content
    finally:
        server.stop()
    assert text == "café the"
    expected = [[int(p[3:5], 16)] if p.startswith("<0x") else list(p.replace("▁", " ").encode()) for p in pieces]
    assert [e.bytes for e in entries] == expected
    assert [e.token for e in entries][3:5] == ["\ufffd", "\ufffd"]  # the text of half a character
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == text
