"""`mlx-spec serve` on tiny models, driven by the official `openai` client (and raw HTTP for
malformed requests). References: `mlx-spec generate --json` for the same prompt and
settings, and mlx-lm's own greedy `generate_step` with its tokenizer's chat template."""

import socket
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from cli_support import assert_one_line_error, invoke, invoke_json
from conftest import greedy_reference
from mlx_lm import generate, load
from server_support import Server, assert_openai_error, server_env, serving

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, models, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

GAMMA = "2"


@pytest.fixture(scope="module")
def spec_env(cost_cache):
    return server_env(cost_cache)


@pytest.fixture(scope="module")
def spec_server(tiny_dirs, spec_env):
    """Drafting with the draft model at a fixed γ."""
    target, draft = tiny_dirs
    yield from serving(["--model", target, "--draft-model", draft, "--gamma", GAMMA], spec_env)


@pytest.fixture(scope="module")
def plain_server(tiny_dirs, spec_env):
    target, _ = tiny_dirs
    yield from serving(["--model", target, "--drafter", "none"], spec_env)


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """mlx-lm's model and tokenizer for the target, loaded independently of mlx-spec."""
    model, tokenizer = load(tiny_dirs[0])
    eos = set(tokenizer.eos_token_ids)  # mlx-lm's own: <eos> and <end_of_turn>

    def greedy(prompt_ids, max_tokens):
        """(tokens up to and including the first EOS, mlx-lm's text for them: its streaming
        detokenizer, which renders ids past the tokenizer's vocabulary as "!")."""
        tokens = greedy_reference(model, prompt_ids, max_tokens)
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[: i + 1]
                break
        return tokens, generate(model, tokenizer, prompt_ids, max_tokens=max_tokens)

    def chat_ids(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    return greedy, chat_ids, tokenizer


def _cli_flags(tiny_dirs, drafting: bool):
    target, draft = tiny_dirs
    if drafting:
        return ["--model", target, "--draft-model", draft, "--gamma", GAMMA]
    return ["--model", target, "--drafter", "none"]


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_models_and_health(spec_server, tiny_dirs):
    client = spec_server.client()
    assert [m.id for m in client.models.list().data] == [tiny_dirs[0]]
    health = spec_server.health()
    assert health["status"] == "ok" and health["drafter"] == "model" and health["gamma"] == GAMMA


def test_health_names_a_local_model_by_its_folder_only(spec_server, tiny_dirs):
    """Issue 33, item 12: /health needs no key, so it shows no local path (the models'
    folders, the user's home), only the folder's name."""
    response = httpx.get(spec_server.url + "/health", timeout=10)
    assert response.json()["model"] == Path(tiny_dirs[0]).name
    assert "/" not in response.text, response.text


def test_served_model_name(tiny_dirs, spec_env):
    """Issue 33, item 12: --served-model-name (vLLM's flag) is the one name clients see and
    send, the path behind it stays on the machine."""
    name = "tiny-gemma"
    # --strict-model-names: other names get a 404 (by default any name is answered, under this one)
    server = Server(["--model", tiny_dirs[0], "--drafter", "none", "--served-model-name", name,
                     "--api-key", "sekret", "--strict-model-names"], spec_env)
    try:
        assert f"mlx-spec serve: {name!r}" in server.log
        client = server.client(api_key="sekret")
        assert [m.id for m in client.models.list().data] == [name]
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3)
        assert chat.model == name and chat.usage.completion_tokens >= 1
        with pytest.raises(openai.NotFoundError) as error:  # as vLLM: the path is not a name now
            client.completions.create(model=tiny_dirs[0], prompt="hi", max_tokens=2)
        assert f"this server serves {name!r}" in error.value.body["message"]
        message = anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0).messages.create(
            model=name, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
        assert message.model == name
        health = httpx.get(server.url + "/health", timeout=10)  # no key
        assert health.json()["model"] == name and "/" not in health.text, health.text
    finally:
        server.stop()
    assert "Traceback" not in server.log
    assert "--served-model-name" in invoke(["serve", "--help"]).stdout


@pytest.mark.parametrize("drafting", [True, False], ids=["draft-model", "drafter-none"])
def test_greedy_completion_equals_generate_and_mlx_lm(drafting, request, tiny_dirs, reference):
    server = request.getfixturevalue("spec_server" if drafting else "plain_server")
    greedy, _, tokenizer = reference
    prompt = "Hello there"
    answer = server.client().completions.create(model=tiny_dirs[0], prompt=prompt, max_tokens=24,
                                                temperature=0)
    cli = invoke_json(["generate", prompt, "--raw", "-n", 24, "--temp", 0, *_cli_flags(tiny_dirs, drafting)])
    tokens, text = greedy(tokenizer.encode(prompt), 24)
    assert answer.choices[0].text == cli["text"] == text
    assert answer.choices[0].finish_reason == cli["finish_reason"]
    assert answer.usage.prompt_tokens == cli["prompt_tokens"]
    assert answer.usage.completion_tokens == cli["generated_tokens"] == len(tokens)
    stats = answer.model_extra["mlx_spec"]
    if drafting:
        assert stats["drafter"] == "model" and stats["drafted"] > 0
        assert len(stats["acceptance_by_position"]) == int(GAMMA)
        assert 0 <= stats["acceptance_rate"] <= 1 and stats["decode_tps"] > 0
    else:
        assert stats["drafter"] == "none" and stats["drafted"] == 0 and stats["gamma"] == "0"


def test_greedy_chat_streamed_and_not_equal_generate_chat(spec_server, tiny_dirs):
    client = spec_server.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=tiny_dirs[0], messages=messages, max_tokens=20,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=tiny_dirs[0], messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    cli = invoke_json(["generate", "Tell me a story", "--chat", "-n", 20, "--temp", 0,
                       *_cli_flags(tiny_dirs, True)])
    assert whole.choices[0].message.content == streamed == cli["text"]
    assert whole.choices[0].message.role == "assistant"
    assert finishes == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.model_extra["mlx_spec"]["generated"] == whole.usage.completion_tokens


def test_stop_strings_streamed_and_not(spec_server, tiny_dirs):
    client = spec_server.client()
    ask = dict(model=tiny_dirs[0], prompt="Hello", max_tokens=40, temperature=0)
    full = client.completions.create(**ask).choices[0].text
    stop = full[12:14]
    cut = client.completions.create(**ask, stop=["#never#", stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.find(stop)]
    cli = invoke_json(["generate", "Hello", "--raw", "-n", 40, "--temp", 0, "--stop", stop,
                       *_cli_flags(tiny_dirs, True)])
    # only the tokens shown are counted: not the stop string, nor what followed it
    assert cut.usage.completion_tokens == cli["generated_tokens"] < 40
    pieces = list(client.completions.create(**ask, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == full[: full.find(stop)]
    assert pieces[-1].choices[0].finish_reason == "stop"
    # without include_usage the finish chunk still carries the statistics
    assert pieces[-1].model_extra["mlx_spec"]["generated"] == cut.usage.completion_tokens


@pytest.mark.parametrize("drafting", [True, False])  # γ 2, and γ 0: plain rounds, pipelined by generate
def test_seeded_sampling_reproduces_generate(request, tiny_dirs, drafting):
    """The server batches every request (`--parallel` 4), `generate` decodes alone: the seed's
    key splits the same way either way."""
    client = request.getfixturevalue("spec_server" if drafting else "plain_server").client()
    sampling = dict(temperature=0.9, top_p=0.95, seed=7)
    extra = {"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.1}
    runs = [client.completions.create(model=tiny_dirs[0], prompt="Hello", max_tokens=24,
                                      extra_body=extra, **sampling).choices[0].text for _ in range(2)]
    cli = invoke_json(["generate", "Hello", "--raw", "-n", 24, "--temp", 0.9, "--top-p", 0.95,
                       "--top-k", 40, "--min-p", 0.02, "--repetition-penalty", 1.1, "--seed", 7,
                       *_cli_flags(tiny_dirs, drafting)])
    assert runs[0] == runs[1] == cli["text"]


FIRST_TURNS = ["Hello", "Count to five", "Why?", "What is two plus two?", "xyz", "no"]


def test_prefix_reuse_and_rollback(spec_server, tiny_dirs, reference):
    """Turn 2 prefills only the tokens after turn 1's prompt and answer; a request that
    diverges rolls back to the common prefix. Expected counts come from mlx-lm's tokenizer
    and greedy decode: after a request the target's cache holds its prompt and answer except
    the answer's last token (never fed back)."""
    greedy, chat_ids, _ = reference
    client = spec_server.client()
    n = 8

    def ask(messages):
        # the answer's text as the model wrote it, control tokens too: it goes back as history
        return client.chat.completions.create(model=tiny_dirs[0], messages=messages, max_tokens=n,
                                              temperature=0, extra_body={"skip_special_tokens": False})

    def follow_up(turn1, answer):
        return turn1 + [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "And what do you do all day?"}]

    # Random weights answer in random bytes; take a first turn whose answer re-tokenizes to
    # the same ids inside the template, so the whole answer can come from the cache.
    for first in FIRST_TURNS:
        turn1 = [{"role": "user", "content": first}]
        p1 = chat_ids(turn1)
        g1, a1 = greedy(p1, n)
        if chat_ids(follow_up(turn1, a1))[: len(p1) + len(g1)] == p1 + g1:
            break
    else:
        pytest.fail("no first turn's answer re-tokenizes to its own ids")
    assert ask(turn1).choices[0].message.content == a1
    turn2 = follow_up(turn1, a1)
    second = ask(turn2)
    p2 = chat_ids(turn2)
    new = len(p2) - len(p1) - len(g1)  # the follow-up's template tokens, plus g1's last token
    stats = second.model_extra["mlx_spec"]
    assert second.usage.prompt_tokens == len(p2)
    assert second.usage.prompt_tokens_details.cached_tokens == len(p1) + len(g1) - 1
    assert stats["prefill_tokens_target"] == new
    assert stats["prefill_tokens"] <= 2 * new + 1  # both models (the draft may lag a token)
    assert second.choices[0].message.content == greedy(p2, n)[1]

    g2, _ = greedy(p2, n)
    diverging = [{"role": "user", "content": first + "!"}]
    third = ask(diverging)
    p3 = chat_ids(diverging)
    common = _common_prefix(p3[:-1], p2 + g2[:-1])
    assert 0 < common < len(p1)
    assert third.usage.prompt_tokens_details.cached_tokens == common
    assert third.model_extra["mlx_spec"]["prefill_tokens_target"] == len(p3) - 1 - common
    assert third.choices[0].message.content == greedy(p3, n)[1]


MALFORMED = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b'{"model": "m", "prompt": "caf\xe9"}', 400, "not valid UTF-8"),
    (b'{"model": "MODEL", "prompt": "a\\ud800b"}', 400, "lone surrogate"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "MODEL", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": "MODEL", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "MODEL", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "MODEL", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": "MODEL", "prompt": "hi", "temperature": -1}, 400, "temperature: must be between 0 and 2"),
    ({"model": "MODEL", "prompt": "hi", "top_p": 0}, 400, "top-p"),
    ({"model": "MODEL", "prompt": "hi", "top_p": 1.5}, 400, "top-p"),
    ({"model": "MODEL", "prompt": "hi", "min_p": 1}, 400, "min-p"),
    ({"model": "MODEL", "prompt": "hi", "top_k": -1}, 400, "top-k"),
    ({"model": "MODEL", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition penalty"),
    ({"model": "MODEL", "prompt": "hi", "seed": -1}, 400, "seed"),
    ({"model": "MODEL", "prompt": "hi", "n": 2}, 400, "n = 1"),
    ({"model": "MODEL", "prompt": [1, 99999]}, 400, "token ids"),
    ({"model": "MODEL", "prompt": []}, 400, "empty"),
    ({"model": "MODEL", "prompt": "x" * 5000}, 400, "context is 4096 tokens"),
]

MALFORMED_CHAT = [
    ({"model": "MODEL", "messages": []}, 400, "messages"),
    ({"model": "MODEL", "messages": "hi"}, 400, "messages"),
    ({"model": "MODEL", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "content"),
]


def _with_model(body, model):
    if isinstance(body, bytes):
        return body.replace(b"MODEL", model.encode())
    return {k: (model if v == "MODEL" else v) for k, v in body.items()}


@pytest.mark.parametrize("path,cases", [("/completions", MALFORMED), ("/chat/completions", MALFORMED_CHAT)],
                         ids=["completions", "chat"])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(path, cases, spec_server, tiny_dirs):
    for body, status, fragment in cases:
        response = spec_server.post(path, _with_model(body, tiny_dirs[0]))
        assert_openai_error(response, status, fragment)
    for method, route in [("GET", "/nope"), ("GET", "/completions")]:
        response = httpx.request(method, spec_server.base + route)
        assert_openai_error(response, 404 if route == "/nope" else 405)
    with pytest.raises(openai.BadRequestError) as error:  # the official client sees the same
        spec_server.client().completions.create(model=tiny_dirs[0], prompt="hi", temperature=-1)
    assert error.value.body["message"] == "temperature: must be between 0 and 2, not -1"
    answer = spec_server.client().completions.create(model=tiny_dirs[0], prompt="hi", max_tokens=4)
    assert answer.usage.completion_tokens >= 1
    assert spec_server.health()["failed"] == 0 and "Traceback" not in spec_server.log


def test_nulls_and_unknown_fields_are_accepted(spec_server, tiny_dirs):
    """Clients send null for options they leave unset, and fields we do not know."""
    body = {"model": tiny_dirs[0], "messages": [{"role": "developer", "content": "Be brief."},
                                                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 3, "n": None, "stop": None, "stream": None, "temperature": None,
            "frequency_penalty": 0, "presence_penalty": None, "logprobs": False, "user": "u1",
            "response_format": {"type": "text"}, "some_future_field": [1, 2]}
    response = spec_server.post("/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_api_key_and_a_public_host(tiny_dirs, spec_env):
    server = Server(["--model", tiny_dirs[0], "--drafter", "none", "--host", "0.0.0.0",
                     "--api-key", "sekret"], spec_env)
    try:
        assert "warning: listening on 0.0.0.0" in server.log
        assert "add --api-key" not in server.log  # a key is set
        port = server.url.rsplit(":", 1)[1]
        server.base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").completions.create(model=tiny_dirs[0], prompt="hi")
        keyed = server.client(api_key="sekret")
        assert keyed.completions.create(model=tiny_dirs[0], prompt="hi", max_tokens=3).choices
    finally:
        server.stop()


def test_a_taken_port_is_a_one_line_error(tiny_dirs):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = invoke(["serve", "--model", tiny_dirs[0], "--port", port])
    assert_one_line_error(result, "cannot listen on 127.0.0.1")
