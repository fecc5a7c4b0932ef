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


def byte_level_label(tokenizer, token: int) -> str:
    """The log-prob label OpenAI's format gives a token of this byte-level tokenizer, from
    mlx-lm's own byte table: its text, or "bytes:" and its bytes escaped where they are not
    whole UTF-8 alone; an id past the vocabulary is "token_id:N" (vLLM's spelling)."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    if token >= len(tokenizer.get_vocab()):
        return f"token_id:{token}"
    piece = tokenizer.convert_ids_to_tokens(token)
    if piece in tokenizer.all_special_tokens:
        return piece
    data = bytes(_byte_decoder()[c] for c in piece)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_targets_for_drafted_tokens_too(stream, spec_server, tiny_dirs, reference):
    model, tokenizer = reference
    messages = [{"role": "user", "content": "Tell me a story about a cat"}]
    n, top = 24, 3
    ask = dict(model=tiny_dirs[0], messages=messages, max_tokens=n, temperature=0, logprobs=True,
               top_logprobs=top)
    if stream:
        chunks = list(spec_server.client().chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        stats, usage = chunks[-1].model_extra["mlx_spec"], chunks[-1].usage
    else:
        answer = spec_server.client().chat.completions.create(**ask)
        content, text = answer.choices[0].logprobs.content, answer.choices[0].message.content
        stats, usage = answer.model_extra["mlx_spec"], answer.usage
    assert stats["accepted"] > 0  # some of the tokens scored came from the draft
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    expected = [(t, lp) for t, lp in mlx_lm_logprobs(model, prompt, n)]
    eos = set(tokenizer.eos_token_ids)
    for i, (t, _) in enumerate(expected):
        if t in eos:  # the EOS has its entry too (usage counts it) and adds no bytes
            expected = expected[: i + 1]
            break
    assert len(content) == len(expected) == usage.completion_tokens > 0
    # each token's own bytes (a byte-level piece: one byte per character), which join back
    # into the answer where decoding tokens one by one gives U+FFFD for split characters
    assert bytes(b for entry in content for b in entry.bytes).decode("utf-8", "replace") == text
    for entry, (token, logprobs) in zip(content, expected):
        assert entry.token == byte_level_label(tokenizer, token)
        _assert_close(entry.logprob, logprobs[token].item())
        ids = mx.argsort(-logprobs)[:top].tolist()
        assert [a.token for a in entry.top_logprobs] == [byte_level_label(tokenizer, i) for i in ids]
        for alt, i in zip(entry.top_logprobs, ids):
            _assert_close(alt.logprob, logprobs[i].item())


def test_completion_logprobs_and_checks(spec_server, tiny_dirs, reference):
    model, tokenizer = reference
    client = spec_server.client()
    prompt = "Hello there, how"
    keep = {"skip_special_tokens": False}  # the text as the tokens write it, for text_offset
    answer = client.completions.create(model=tiny_dirs[0], prompt=prompt, max_tokens=16, temperature=0,
                                       logprobs=2, extra_body=keep)
    got = answer.choices[0].logprobs
    expected = mlx_lm_logprobs(model, tokenizer.encode(prompt), len(got.tokens))
    assert len(got.tokens) == answer.usage.completion_tokens  # an EOS too, if it stopped
    for i, (token, logprobs) in enumerate(expected):
        _assert_close(got.token_logprobs[i], logprobs[token].item())
        assert got.tokens[i] == byte_level_label(tokenizer, token)
        ids = mx.argsort(-logprobs)[:2].tolist()
        assert got.top_logprobs[i] == pytest.approx(
            {byte_level_label(tokenizer, j): logprobs[j].item() for j in ids}, abs=2e-4)
    offsets = got.text_offset  # characters, not label lengths (exact: test_byte_tokens_...)
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(answer.choices[0].text)
    assert all(math.isfinite(v) and v <= 0 for v in got.token_logprobs)
    plain = client.completions.create(model=tiny_dirs[0], prompt=prompt, max_tokens=16, temperature=0, extra_body=keep)
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
    Ollama refuse them), unless tool_choice is "none" (or forces a call: test_agents_structured.py)."""
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
    assert [byte_level_label(tokenizer, t) for t, _ in expected] == got.tokens
    unpenalized = mlx_lm_logprobs(model, tokenizer.encode(prompt), len(got.tokens))
    assert any(abs(a[1][a[0]].item() - b[1][b[0]].item()) > 1e-2 for a, b in zip(expected, unpenalized))
    for i, (token, logprobs) in enumerate(expected):
        _assert_close(got.token_logprobs[i], logprobs[token].item())
        _assert_close(got.token_logprobs[i], mx.max(logprobs).item())  # greedy took the likeliest
        alternatives = {byte_level_label(tokenizer, j): logprobs[j].item() for j in mx.argsort(-logprobs)[:2].tolist()}
        assert got.top_logprobs[i] == pytest.approx(alternatives, abs=2e-4)


# A Gemma-style SentencePiece vocabulary with byte fallback (`tiny_gemma4`): ids 6..261 are
# <0x00>..<0xFF>, 270 is "▁the". The scripted answer spells "😀你好café the" in byte tokens
# but the last, as SentencePiece spells characters it has no piece for: the emoji is four
# tokens, each CJK character three, é two; each alone decodes to U+FFFD.
BYTE_TOKEN = 6
ANSWER = "😀你好café the"
SCRIPT = [BYTE_TOKEN + b for b in "😀你好café".encode()] + [270]
CONTINUATION_BYTES = [BYTE_TOKEN + b for b in range(0x80, 0xC0)]  # each alone is U+FFFD


def spm_label(piece: str) -> str:
    """OpenAI's label for a SentencePiece piece: a byte token as "bytes:" and its byte
    (escaped unless printable ASCII: a piece may spell the same character), else its text."""
    if piece.startswith("<0x"):
        b = int(piece[3:5], 16)
        return "bytes:" + (chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}")
    return piece.replace("▁", " ")


@pytest.fixture(scope="module")
def byte_token_server(tmp_path_factory):
    """A scripted target (`ScriptedModel`) answering `SCRIPT` on the SentencePiece vocabulary,
    whose every row also favours the 64 UTF-8 continuation bytes (distinct logits): so a
    position's top 20 alternatives are mostly byte tokens whose text is U+FFFD."""
    from mlx_lm.utils import load_tokenizer
    from scripted_model import END_OF_TURN_ID, EOS_ID, VOCAB, InProcessServer, ScriptedModel

    from mlx_spec.core.engine import Engine
    from mlx_spec.server import ServerOptions, create_app
    from mlx_spec.testing.tiny_gemma4 import save_sentencepiece_tokenizer

    class FavouringBytes(ScriptedModel):
        bias = mx.zeros(VOCAB).at[mx.array(CONTINUATION_BYTES)].add(10.0 - 0.1 * mx.arange(64))
        mx.eval(bias)  # here: the worker thread cannot evaluate this thread's lazy arrays

        def __call__(self, inputs, cache=None):
            return super().__call__(inputs, cache) + self.bias

    path = tmp_path_factory.mktemp("spm")
    save_sentencepiece_tokenizer(path)
    tokenizer = load_tokenizer(path, eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    model = FavouringBytes()
    model.script = SCRIPT
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name="scripted", gamma="0",
                                                                          context_length=4096)))
    yield server, tokenizer
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprob_bytes_rebuild_multibyte_text(stream, byte_token_server):
    """OpenAI's `bytes` exist so that characters split over tokens can be put back together:
    a byte-fallback token's bytes are its one byte, not the UTF-8 of U+FFFD, and the EOS
    that ended the answer (counted in usage) has its entry and no bytes. Checked against the
    SentencePiece vocabulary itself."""
    server, tokenizer = byte_token_server
    ask = dict(model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
               temperature=0, logprobs=True, top_logprobs=20)
    if stream:
        chunks = list(server.client().chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        answer = server.client().chat.completions.create(**ask)
        entries, text, usage = answer.choices[0].logprobs.content, answer.choices[0].message.content, answer.usage
    assert text == ANSWER
    pieces = tokenizer.convert_ids_to_tokens(SCRIPT) + ["<turn|>"]
    expected = [[int(p[3:5], 16)] if p.startswith("<0x") else list(p.replace("▁", " ").encode()) for p in pieces]
    expected[-1] = []  # the EOS shows no text
    assert [e.bytes for e in entries] == expected and len(entries) == usage.completion_tokens
    assert [e.token for e in entries] == [spm_label(p) for p in pieces]
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == text
    for entry in entries:  # 20 distinct alternatives, the likeliest first: the chosen token
        assert len({a.token for a in entry.top_logprobs}) == 20 and entry.top_logprobs[0].token == entry.token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_top_logprobs_keep_byte_tokens_apart(stream, byte_token_server):
    """Completions' `top_logprobs` is a dict keyed by token text (the legacy OpenAI API):
    byte tokens that all decode to U+FFFD once collapsed into one key. Keyed by label, every
    alternative is there and the chosen token is under its own label with its own log-prob;
    `text_offset` counts characters of the answer, and the EOS (counted in usage) is there."""
    server, tokenizer = byte_token_server
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ask = dict(model="scripted", prompt=list(prompt), max_tokens=40, temperature=0, logprobs=20)
    if stream:
        chunks = list(server.client().completions.create(**ask, stream=True,
                                                         stream_options={"include_usage": True}))
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        got = {key: [v for part in parts for v in getattr(part, key)]
               for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    else:
        answer = server.client().completions.create(**ask)
        got, text, usage = answer.choices[0].logprobs.model_dump(), answer.choices[0].text, answer.usage
    assert text == ANSWER and len(got["tokens"]) == usage.completion_tokens == len(SCRIPT) + 1
    pieces = tokenizer.convert_ids_to_tokens(SCRIPT) + ["<turn|>"]
    assert got["tokens"] == [spm_label(p) for p in pieces]
    for token, logprob, top in zip(got["tokens"], got["token_logprobs"], got["top_logprobs"]):
        assert len(top) == 20 and top[token] == logprob == max(top.values())
    # each token at the character it starts or continues; the EOS at the end
    head = ANSWER[: -len(" the")]  # in byte tokens; " the" is one piece
    starts = [i for i, ch in enumerate(head) for _ in ch.encode()]
    assert got["text_offset"] == starts + [len(head), len(ANSWER)]


def test_padded_ids_show_in_logprobs_as_in_the_text(tmp_path):
    """Checkpoints pad their embedding past the tokenizer; mlx-lm's byte-level detokenizer
    writes such an id as "!". Its log-prob entry is labelled "token_id:N" (it has no
    vocabulary entry) and its bytes are that "!", so the bytes still join into the text
    (they were [] while the text showed "!"). That detokenizer also drops the space an
    answer starts with: so does the first token's bytes."""
    from mlx_lm.utils import load_tokenizer
    from scripted_model import END_OF_TURN_ID, EOS_ID, VOCAB, InProcessServer, ScriptedModel, save_tokenizer

    from mlx_spec.core.engine import Engine
    from mlx_spec.server import ServerOptions, create_app

    tokenizer = load_tokenizer(save_tokenizer(tmp_path), eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    padded = len(tokenizer.get_vocab())
    assert padded < VOCAB
    model = ScriptedModel()
    model.script = tokenizer.encode(" ok", add_special_tokens=False) + [padded]
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name="scripted", gamma="0",
                                                                          context_length=4096)))
    try:
        messages = [{"role": "user", "content": "hi"}]
        chat = server.client().chat.completions.create(model="scripted", messages=messages, max_tokens=8,
                                                       temperature=0, logprobs=True, top_logprobs=2)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        plain = server.client().completions.create(model="scripted", prompt=list(prompt), max_tokens=8,
                                                   temperature=0, logprobs=2)
    finally:
        server.stop()
    content, text = chat.choices[0].logprobs.content, chat.choices[0].message.content
    assert text == "ok!" and [e.token for e in content] == [" ", "o", "k", f"token_id:{padded}", "<turn|>"]
    assert [e.bytes for e in content] == [[], [ord("o")], [ord("k")], [ord("!")], []]
    got = plain.choices[0].logprobs
    assert plain.choices[0].text == text and got.tokens == [e.token for e in content]
    assert got.top_logprobs[3][f"token_id:{padded}"] == got.token_logprobs[3]
    assert got.text_offset == [0, 0, 1, 2, 3]
