"""Issue 18's protections on issue 19's endpoints, where the two branches meet: the request
guards in front of `/v1/messages` (errors in Anthropic's shape, read by the official
`anthropic` SDK) and `/metrics`, `--cors-origin` through the guards, Anthropic's
`stop_sequences` bounded by their total length, the early context bound and the dropped
system prompt on the Messages route, and a queued Messages client that leaves, then a
shutdown that ends Anthropic streams with Anthropic's `error` event. Servers run in-process
with the scripted model (`scripted_model.py`): mlx-lm's tokenizer and template, the real engine
and HTTP path."""

import json
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from scripted_model import END_OF_TURN_ID, EOS_ID, InProcessServer, ScriptedModel, save_tokenizer
from server_support import anthropic_error, assert_openai_error, wait_for

from mlx_spec.core.engine import Engine
from mlx_spec.server import ServerOptions, create_app

MODEL = "scripted"
KEY = "sekret"
ORIGIN = "http://localhost:3000"
HI = [{"role": "user", "content": "hi"}]
# Gemma 3's way with a system turn, without its alternation check: folded into the first
# user turn, so with no user turn it is silently left out.
FOLDING_TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{%- set ns.system = message.content + '\\n\\n' -%}"
    "{%- else -%}{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{%- if message.role == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ message.content | trim }}{{ '<turn|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)


class SlowScriptedModel(ScriptedModel):
    """The scripted model at a known pace, so an answer is still running while a test acts."""

    def __call__(self, inputs, cache=None):
        time.sleep(0.005)
        return super().__call__(inputs, cache)


class HeldTokenizer:
    """The tokenizer, but rendering a conversation that says "hold" waits until `release`
    is set: the tokenizer thread stays busy for as long as a test needs."""

    def __init__(self, tokenizer):
        self._tokenizer, self.holding, self.release = tokenizer, threading.Event(), threading.Event()

    def apply_chat_template(self, messages, **kwargs):
        if any(m["content"] == "hold" for m in messages):
            self.holding.set()
            self.release.wait(60)
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def tokenizer_for(path, template=None):
    folder = save_tokenizer(path) if template is None else save_tokenizer(path, template)
    return load_tokenizer(folder, eos_token_ids=[EOS_ID, END_OF_TURN_ID])


def start(tokenizer, model=None, **options) -> InProcessServer:
    model = model or ScriptedModel()
    engine = Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    app = create_app(engine, tokenizer, ServerOptions(model_name=MODEL, gamma="0",
                                                      context_length=4096, **options))
    server = InProcessServer(app)
    server.model, server.url, server.worker = model, server.base.removesuffix("/v1"), app.state.worker
    return server


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tokenizer_for(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def keyed(tokenizer):
    server = start(tokenizer, api_key=KEY)
    yield server
    server.stop()


def claude(server, key=KEY, **kwargs):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0,
                               **{"timeout": 60, **kwargs})


def say(server, tokenizer, text):
    server.model.script = list(tokenizer.encode(text, add_special_tokens=False))


def declare_a_huge_body(server, path: str) -> tuple[int, dict]:
    """POST headers declaring 100 MB and no body: the guards answer before reading any."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nx-api-key: {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_the_guards_answer_the_messages_routes_in_anthropics_shape(keyed, tokenizer):
    say(keyed, tokenizer, "Hello")
    wrong = claude(keyed, "wrong").messages
    for call in (lambda: wrong.create(model=MODEL, max_tokens=5, messages=HI),
                 lambda: wrong.count_tokens(model=MODEL, messages=HI)):
        with pytest.raises(anthropic.AuthenticationError) as error:
            call()
        assert error.value.body["type"] == "error"
        assert error.value.body["error"]["type"] == "authentication_error"
    # a page that rebinds its DNS name to 127.0.0.1 sends its own Host: refused, not served
    foreign = claude(keyed, default_headers={"Host": "attacker.example"})
    with pytest.raises(anthropic.PermissionDeniedError) as error:
        foreign.messages.create(model=MODEL, max_tokens=5, messages=HI)
    assert error.value.body["error"]["type"] == "permission_error"
    assert "attacker.example" in error.value.body["error"]["message"]
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    plain = httpx.post(keyed.url + "/v1/messages", content=b'{"model": "scripted"}',
                       headers={**headers, "content-type": "text/plain"}, timeout=30)
    assert "application/json" in anthropic_error(plain, 415, "invalid_request_error")
    status, huge = declare_a_huge_body(keyed, "/v1/messages")
    assert status == 413 and huge["error"]["type"] == "request_too_large", huge
    wrong_method = httpx.get(keyed.url + "/v1/messages", headers=headers, timeout=30)
    anthropic_error(wrong_method, 405, "invalid_request_error")  # the router's own errors too
    # the same refusals elsewhere stay in OpenAI's shape; the key works as x-api-key
    assert_openai_error(httpx.post(keyed.base + "/chat/completions", json={}, timeout=30), 401,
                        "API key")
    answer = claude(keyed).messages.create(model=MODEL, max_tokens=5, messages=HI)
    assert answer.content[0].text == "Hello"
    # /metrics needs the key too; /health alone is open
    assert_openai_error(httpx.get(keyed.url + "/metrics", timeout=30), 401, "API key")
    metrics = httpx.get(keyed.url + "/metrics", headers={"x-api-key": KEY}, timeout=30)
    assert metrics.status_code == 200 and "mlx_spec_http_responses_total" in metrics.text
    assert 'code="401"' in metrics.text and 'code="403"' in metrics.text  # refusals counted
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200


def test_a_cors_origin_works_through_the_guards(tokenizer):
    server = start(tokenizer, api_key=KEY, cors_origins=(ORIGIN,))
    try:
        for path, asked in (("/v1/chat/completions", "authorization, content-type"),
                            ("/v1/messages", "x-api-key, anthropic-version, content-type")):
            preflight = httpx.options(server.url + path, timeout=30, headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": asked})  # no key: browsers never send one here
            assert preflight.status_code == 200, preflight.text
            assert preflight.headers["access-control-allow-origin"] == ORIGIN
            assert "POST" in preflight.headers["access-control-allow-methods"]
        say(server, tokenizer, "Hi there")
        body = {"model": MODEL, "messages": HI, "max_tokens": 10}
        seen = {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
        answer = httpx.post(server.base + "/chat/completions", json=body, headers=seen, timeout=30)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "Hi there"
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        message = httpx.post(server.url + "/v1/messages", json=body, timeout=30,
                             headers={"Origin": ORIGIN, "x-api-key": KEY})
        assert message.status_code == 200 and message.json()["content"][0]["text"] == "Hi there"
        assert message.headers["access-control-allow-origin"] == ORIGIN
        # refusals reach the page with CORS headers, so it can read why; JSON is still required
        plain = httpx.post(server.base + "/chat/completions", content=b"{}", timeout=30,
                           headers={**seen, "content-type": "text/plain"})
        assert_openai_error(plain, 415, "application/json")
        assert plain.headers["access-control-allow-origin"] == ORIGIN
        keyless = httpx.post(server.url + "/v1/messages", json=body, headers={"Origin": ORIGIN}, timeout=30)
        anthropic_error(keyless, 401, "authentication_error")
        assert keyless.headers["access-control-allow-origin"] == ORIGIN
        # another origin gets no CORS headers, so its page cannot read anything
        other = {"Origin": "http://attacker.example"}
        refused = httpx.options(server.base + "/chat/completions", timeout=30, headers={
            **other, "Access-Control-Request-Method": "POST"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        foreign = httpx.post(server.base + "/chat/completions", json=body, headers={**seen, **other}, timeout=30)
        assert "access-control-allow-origin" not in foreign.headers
    finally:
        server.stop()


def test_stop_sequences_are_bounded_by_their_total_length(keyed, tokenizer):
    client = claude(keyed)
    say(keyed, tokenizer, "one two three")
    # more than OpenAI's 4 is Anthropic's right; the total is what bounds the matcher's work
    many = [f"never{i:02d}" + "x" * 90 for i in range(8)] + ["three"]
    message = client.messages.create(model=MODEL, max_tokens=30, stop_sequences=many, messages=HI)
    assert message.content[0].text == "one two " and message.stop_sequence == "three"
    for stops, fragment in (([" " * 257], "at most 256 characters"),
                            (["y" * 256] * 5, "at most 1024 characters together")):
        with pytest.raises(anthropic.BadRequestError) as error:
            client.messages.create(model=MODEL, max_tokens=5, stop_sequences=stops, messages=HI)
        assert error.value.body["error"]["type"] == "invalid_request_error"
        assert fragment in error.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError):
            with client.messages.stream(model=MODEL, max_tokens=5, stop_sequences=stops, messages=HI) as s:
                list(s)
    with pytest.raises(openai.BadRequestError) as error:  # OpenAI's own rule stays: at most 4
        keyed.client(api_key=KEY).completions.create(model=MODEL, prompt="hi", max_tokens=5,
                                                     stop=["a", "b", "c", "d", "e"])
    assert "at most 4 stop strings" in error.value.body["message"]


def test_messages_that_cannot_fit_are_refused_before_tokenizing(keyed):
    text = "word " * 400_000  # 2 MB: a tokenizer's work of seconds, refused at once
    client = claude(keyed)
    big = [{"role": "user", "content": text}]
    for call in (lambda: client.messages.create(model=MODEL, max_tokens=5, messages=big),
                 lambda: client.messages.count_tokens(model=MODEL, messages=big)):
        began = time.monotonic()
        with pytest.raises(anthropic.BadRequestError) as error:
            call()
        assert "the request's text alone needs at least" in error.value.body["error"]["message"]
        assert time.monotonic() - began < 10  # a loose bound: the machine is shared


def test_prompts_being_tokenized_hold_their_place_and_count_tokens_is_bounded(tokenizer):
    """Issue 33, item 8: prompts waited for the tokenizer thread in an unbounded queue,
    before the queue-full check, and count_tokens met no bound: a burst of large prompts
    lined up seconds of work. A prompt being tokenized now holds its place in the queue,
    and count_tokens waits only while fewer than --queue-size prompts tokenize; the next
    request gets 503 with Retry-After at once, in its API's shape."""
    held = HeldTokenizer(tokenizer)
    server = start(held, queue_size=2)
    try:
        say(server, tokenizer, "Fine")
        answers: dict = {}

        def ask(i, content):
            answers[i] = claude(server).messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": content}])

        holding = threading.Thread(target=ask, args=(0, "hold"))
        holding.start()
        assert held.holding.wait(10)  # the tokenizer thread is busy with it
        waiting = threading.Thread(target=ask, args=(1, "hi"))
        waiting.start()
        wait_for(lambda: httpx.get(server.url + "/health", timeout=10).json()["tokenizing"] == 2, 10,
                 "two prompts tokenizing")
        assert server.worker.health()["queued"] == 0  # they hold the queue's two places
        with pytest.raises(openai.InternalServerError) as error:  # 503, not a wait
            server.client().with_options(timeout=5).chat.completions.create(model=MODEL, messages=HI)
        assert error.value.status_code == 503 and error.value.body["code"] == "server_busy"
        assert int(error.value.response.headers["retry-after"]) >= 1
        for call in (lambda c: c.messages.create(model=MODEL, max_tokens=5, messages=HI),
                     lambda c: c.messages.count_tokens(model=MODEL, messages=HI)):
            with pytest.raises(anthropic.InternalServerError) as error:
                call(claude(server, timeout=5))
            assert error.value.status_code == 503
            assert error.value.body["error"]["type"] == "overloaded_error"
            assert int(error.value.response.headers["retry-after"]) >= 1
        held.release.set()
        holding.join(30)
        waiting.join(30)
        assert answers[0].content[0].text == answers[1].content[0].text == "Fine"
        hi = len(tokenizer.apply_chat_template(HI, add_generation_prompt=True))
        assert claude(server).messages.count_tokens(model=MODEL, messages=HI).input_tokens == hi
        assert server.worker.health()["refused"] == 2  # the generations, not the count
    finally:
        held.release.set()
        server.stop()


def test_a_system_prompt_the_template_leaves_out_is_refused(tmp_path):
    tokenizer = tokenizer_for(tmp_path, FOLDING_TEMPLATE)
    server = start(tokenizer)
    try:
        client = claude(server)
        with pytest.raises(anthropic.BadRequestError) as error:
            client.messages.create(model=MODEL, max_tokens=5, system="Answer in French.",
                                   messages=[{"role": "assistant", "content": "Bonjour"}])
        assert "a system message needs a user message after it" in error.value.body["error"]["message"]
        say(server, tokenizer, "Salut")
        kept = client.messages.create(model=MODEL, max_tokens=5, system="Answer in French.", messages=HI)
        assert kept.content[0].text == "Salut"
        seen = tokenizer.decode(server.model.seen)
        assert "Answer in French." in seen
    finally:
        server.stop()


def test_a_queued_messages_client_that_leaves_frees_its_place_and_shutdown_ends_the_streams(tokenizer):
    server = start(tokenizer, model=SlowScriptedModel(), queue_size=1)
    try:
        say(server, tokenizer, "a" * 3000)  # ≥ 15 s at the model's pace
        client = claude(server)
        running = client.messages.stream(model=MODEL, max_tokens=3000, messages=HI).__enter__()
        events = iter(running)
        for event in events:
            if event.type == "content_block_delta":
                break
        assert server.model.seen  # it generates
        with pytest.raises(anthropic.APITimeoutError):  # waits in the queue, then leaves
            claude(server, timeout=1).messages.create(model=MODEL, max_tokens=5, messages=HI)
        wait_for(lambda: httpx.get(server.url + "/health", timeout=10).json()["queued"] == 0, 3,
                 "freed")
        queued: dict = {}

        def wait_streamed():
            try:
                with client.messages.stream(model=MODEL, max_tokens=5, messages=HI) as stream:
                    queued["events"] = [e.type for e in stream]
            except anthropic.APIStatusError as error:
                queued["error"] = error.body

        waiter = threading.Thread(target=wait_streamed)
        waiter.start()
        wait_for(lambda: httpx.get(server.url + "/health", timeout=10).json()["queued"] == 1, 10,
                 "queued")
        server.worker.shut_down()  # what SIGTERM/SIGINT do (`cli.serve._run`)
        with pytest.raises(anthropic.APIStatusError) as error:
            for event in events:
                assert event.type != "message_stop"
        running.__exit__(None, None, None)
        assert error.value.body["error"] == {"type": "overloaded_error",
                                             "message": "the server is shutting down"}
        waiter.join(30)
        assert queued["error"]["error"]["type"] == "overloaded_error", queued
        with pytest.raises(anthropic.InternalServerError) as error:
            client.messages.create(model=MODEL, max_tokens=5, messages=HI)
        assert error.value.status_code == 503
        assert error.value.body["error"]["type"] == "overloaded_error"
    finally:
        server.stop()
