"""`mlx-spec serve` against bodies built to cost it (issue 32, defects 1 and 2, slow bodies,
temperature, CORS): element counts bounded before the body is parsed or validated, parsing
off the event loop so other clients (and a running stream) go on, memory given back, every
malformed body a 400 in its route's shape on a connection that stays usable (pipelined
requests too), and a body that trickles in refused with a 408. A live server in a
subprocess where timing and memory are measured; the scripted in-process server
(`scripted_model`) where a test must break a route or set a CORS origin. References: the
official `openai` and `anthropic` clients, raw sockets for what no client sends."""

import http.client
import json
import select
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer
from scripted_model import END_OF_TURN_ID, EOS_ID, InProcessServer, ScriptedModel, save_tokenizer
from server_support import (
    anthropic_error,
    assert_openai_error,
    server_env,
    server_port,
    server_rss_mib,
    serving,
    start_long_stream,
)

from mlx_spec.core.engine import Engine
from mlx_spec.server import ServerOptions, create_app

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache

BODY_TIMEOUT_S = 2
KEEP_ALIVE_S = 1
LONG_INT = "7" * 5000  # past Python's 4,300-digit int conversion limit


@pytest.fixture(scope="module")
def server(tiny_dirs, cost_cache):
    yield from serving(["--model", tiny_dirs[0], "--drafter", "none", "--body-timeout",
                        BODY_TIMEOUT_S, "--timeout-keep-alive", KEEP_ALIVE_S], server_env(cost_cache))




def _bodies(model: str) -> list:
    """(name, path, body bytes, fragment of the 400) for bodies of 11-16 MiB, each under the
    16 MiB limit, each of which took 3-6 s on the event loop before."""
    user = [{"role": "user", "content": "hi"}]
    bodies = [
        ("ignored list", "/completions",
         {"model": model, "prompt": "hi", "max_tokens": 2, "ignored": [0] * 5_000_000},
         "more than 1048576 values"),
        ("token ids", "/completions", {"model": model, "prompt": [1] * 5_500_000},
         "more than 1048576 values"),
        ("tools", "/chat/completions",
         {"model": model, "messages": user, "tool_choice": "none",
          "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(120_000)]},
         "more than 32768 objects"),
        ("text blocks", "/messages",
         {"model": model, "max_tokens": 2,
          "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 400_000}]},
         "more than 1048576 values"),
        ("stop sequences", "/messages",
         {"model": model, "max_tokens": 2, "messages": user, "stop_sequences": [""] * 3_500_000},
         "more than 1048576 values"),
    ]
    return [(name, path, json.dumps(body).encode(), said) for name, path, body, said in bodies]


@pytest.fixture(scope="module")
def huge_bodies(tiny_dirs):
    return _bodies(tiny_dirs[0])


def _message(path: str, response: httpx.Response) -> str:
    if path.startswith("/messages"):
        return anthropic_error(response, 400, "invalid_request_error")
    return assert_openai_error(response, 400)["message"]


# -- the shape of a body, counted before it is parsed -------------------------------------


def _document(rng, depth=0):
    """A random JSON value whose strings are full of what the byte count must skip."""
    kind = rng.choice(["list", "dict", "str", "num"] if depth < 6 else ["str", "num"])
    if kind == "list":
        return [_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "dict":
        return {_text(rng): _document(rng, depth + 1) for _ in range(rng.randrange(4))}
    return _text(rng) if kind == "str" else rng.choice([0, -1.5, True, None, 12345])


def _text(rng) -> str:
    return "".join(rng.choice('a"\\,[]{}:é\n') for _ in range(rng.randrange(6)))


def _shape(value, depth=1) -> tuple[int, int, int, int]:
    """(items and members, empty containers, objects, depth) of a parsed value."""
    if not isinstance(value, (list, dict)):
        return 0, 0, 0, depth - 1
    children = list(value.values()) if isinstance(value, dict) else value
    shapes = [_shape(child, depth + 1) for child in children]
    return (len(children) + sum(s[0] for s in shapes), (not children) + sum(s[1] for s in shapes),
            isinstance(value, dict) + sum(s[2] for s in shapes), max([depth] + [s[3] for s in shapes]))


@pytest.mark.parametrize("seed", range(4))
def test_the_counts_taken_before_parsing_are_json_loads_own(seed, monkeypatch):
    """Each limit is met exactly at the count json.loads' own result has (a value per item
    or member, plus the body; an empty container counts one) and refused one below."""
    import random

    from mlx_spec.server import body_bounds as protocol

    rng = random.Random(seed)
    for _ in range(50):
        document = {"messages": [_document(rng) for _ in range(3)]}
        raw = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode()
        members, empty, objects, depth = _shape(document)
        for name, count in [("MAX_JSON_VALUES", 1 + members + empty),
                            ("MAX_JSON_OBJECTS", objects), ("MAX_JSON_DEPTH", depth)]:
            monkeypatch.setattr(protocol, name, count)
            assert protocol.load_json(raw) == document
            monkeypatch.setattr(protocol, name, count - 1)
            with pytest.raises(protocol.ApiError):
                protocol.load_json(raw)
            monkeypatch.undo()


# -- defect 2: huge legal bodies do not freeze the server ---------------------------------


def test_huge_bodies_are_refused_by_their_counts_while_others_are_answered(server, tiny_dirs,
                                                                         huge_bodies):
    server.wait_idle(30)
    client, stream, lines = start_long_stream(server, tiny_dirs[0])
    gaps, last = [], [time.perf_counter()]

    def read_stream():  # the time between chunks of a running generation
        try:
            for line in lines:
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    gaps.append(now - last[0])
                    last[0] = now
                if done.is_set():
                    return
        except httpx.HTTPError:  # closed below
            pass

    done = threading.Event()
    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    try:
        for name, path, body, said in huge_bodies:
            answer = {}
            poster = threading.Thread(target=lambda: answer.update(response=server.post(path, body)))
            health_s = []
            gaps.clear()
            poster.start()
            while poster.is_alive():
                started = time.perf_counter()
                assert httpx.get(server.url + "/health", timeout=30).status_code == 200
                health_s.append(time.perf_counter() - started)
                time.sleep(0.02)
            poster.join()
            # Before: 3-6 s on the event loop, /health and the stream stuck behind it.
            assert max(health_s) < 1.0, (name, health_s)
            assert gaps and max(gaps) < 1.0, (name, max(gaps, default=None))
            assert said in _message(path, answer["response"]), name
    finally:
        done.set()
        stream.close()
        client.close()


def test_memory_comes_back_after_huge_bodies(server, huge_bodies):
    """Before: +90 MiB held after these bodies (glibc keeps what their copies freed)."""
    server.wait_idle(30)
    before = server_rss_mib(server)
    for name, path, body, said in huge_bodies:
        assert said in _message(path, server.post(path, body)), name
    time.sleep(1.5)
    after = server_rss_mib(server)
    assert after - before < 32, (before, after)


@pytest.mark.parametrize("path, body, param, limit", [
    ("/completions", {"prompt": [1] * 300_000}, "prompt", 262144),
    ("/completions", {"prompt": ["hi"] * 300_000}, "prompt", 262144),
    ("/completions", {"prompt": "hi", "stop": ["x"] * 300}, "stop", 4),  # OpenAI's own limit
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 20_001}, "messages", 20000),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 10_001}]},
     "messages[0].content", 10000),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(1025)]}, "tools", 1024),
    ("/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(1025)]}]},
     "messages[0].tool_calls", 1024),
    ("/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 10_001}]},
     "messages[0].content", 10000),
    ("/messages", {"messages": [{"role": "user", "content": "hi"}], "system": [{"type": "text", "text": "a"}] * 10_001},
     "system", 10000),
    ("/messages", {"messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"] * 257},
     "stop_sequences", 256),
    ("/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": f"f{i}", "input_schema": {}} for i in range(1025)]}, "tools", 1024),
], ids=["ids", "prompts", "stop", "messages", "parts", "tools", "tool-calls", "blocks", "system",
        "stop-sequences", "anthropic-tools"])
def test_each_list_is_bounded_and_the_400_names_it(server, tiny_dirs, path, body, param, limit):
    body = {"model": tiny_dirs[0], "max_tokens": 2, **body}
    message = _message(path, server.post(path, body))
    what = "stop strings" if param == "stop" else "items"
    assert message.startswith(f"{param}: at most {limit} {what} are allowed"), message


def test_a_128k_prompt_of_token_ids_is_read(server, tiny_dirs):
    """The bound on prompt ids leaves room: 131,072 ids are parsed and reach the context
    check (this model's context is 4,096 tokens)."""
    response = server.post("/completions", {"model": tiny_dirs[0], "prompt": [1] * 131_072,
                                            "max_tokens": 2})
    assert assert_openai_error(response, 400, "131072 prompt tokens")["code"] == "context_length_exceeded"


# -- defect 1: a malformed body is a 400 on a connection that stays usable -----------------


def _request(method: str, path: str, body: bytes = b"", length: int | None = None) -> bytes:
    """An HTTP/1.1 request's bytes; `length` the Content-Length it claims (default: the body's)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def _responses(sock, count: int, timeout: float = 30) -> list[tuple[int, dict, bytes]]:
    """`count` responses read off one connection: (status, headers, body)."""
    stream, out = sock.makefile("rb"), []
    sock.settimeout(timeout)
    for i in range(count):
        line = stream.readline()
        assert line.startswith(b"HTTP/1.1 "), f"the connection closed after {i} responses"
        status = int(line.split()[1])
        headers = {}
        while (line := stream.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        out.append((status, headers, stream.read(int(headers["content-length"]))))
    return out


def test_a_long_integer_anywhere_is_a_400_on_every_route_and_the_connection_lives(server, tiny_dirs):
    model = tiny_dirs[0]
    user = '[{"role": "user", "content": "hi"}]'
    bodies = {"/v1/completions": f'{{"model": "{model}", "prompt": "hi", "ignored": {LONG_INT}}}',
              "/v1/chat/completions": f'{{"model": "{model}", "messages": {user}, "x": [{LONG_INT}]}}',
              "/v1/messages": f'{{"model": "{model}", "max_tokens": 2, "messages": {user}, "x": {LONG_INT}}}',
              "/v1/messages/count_tokens": f'{{"model": "{model}", "messages": {user}, "metadata": {{"n": {LONG_INT}}}}}'}
    connection = http.client.HTTPConnection("127.0.0.1", server_port(server), timeout=30)
    for path, body in bodies.items():  # one after another on a kept-alive connection
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        assert response.status == 400 and "more than 4300 digits" in text, text
        shaped = json.loads(text)
        assert ("type" in shaped) == path.startswith("/v1/messages"), text
    connection.request("GET", "/v1/models")
    assert connection.getresponse().status == 200
    connection.close()
    with socket.create_connection(("127.0.0.1", server_port(server))) as sock:  # pipelined
        sock.sendall(b"".join(_request("POST", path, body.encode()) for path, body in bodies.items())
                     + _request("GET", "/v1/models"))
        statuses = [status for status, _, _ in _responses(sock, len(bodies) + 1)]
    assert statuses == [400] * len(bodies) + [200]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("scripted")),
                          eos_token_ids=[EOS_ID, END_OF_TURN_ID])


def _in_process(tokenizer, **options) -> InProcessServer:
    engine = Engine(ScriptedModel(), None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(
        model_name="scripted", gamma="0", context_length=4096, **options)))
    server.port = int(server.base.rsplit(":", 1)[1].removesuffix("/v1"))
    return server


def test_after_a_500_the_connection_still_answers(tokenizer, monkeypatch):
    """A route that fails unexpectedly answers 500 in its shape, and the connection goes on:
    uvicorn used to close it behind Starlette's 500, dropping pipelined requests."""
    from mlx_spec.server import serving_anthropic as anthropic_routes
    from mlx_spec.server import serving_openai as app_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "openai_plan", broken)
    monkeypatch.setattr(anthropic_routes, "tool_plan", broken)
    server = _in_process(tokenizer)
    user = [{"role": "user", "content": "hi"}]
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(_request("POST", "/v1/chat/completions", json.dumps(
                {"model": "scripted", "messages": user}).encode())
                + _request("POST", "/v1/messages", json.dumps(
                    {"model": "scripted", "max_tokens": 2, "messages": user}).encode())
                + _request("GET", "/v1/models"))
            (chat, _, chat_body), (messages, _, messages_body), (models, _, _) = _responses(sock, 3)
    finally:
        server.stop()
    assert chat == 500 and json.loads(chat_body)["error"]["message"] == "internal server error"
    assert messages == 500 and json.loads(messages_body) == {
        "type": "error", "error": {"type": "api_error", "message": "internal server error"}}
    assert models == 200


# -- slow bodies: the body has a deadline, an idle connection a keep-alive timeout ---------


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes(server, tiny_dirs):
    with socket.create_connection(("127.0.0.1", server_port(server)), timeout=30) as sock:
        sock.sendall(_request("POST", "/v1/completions", b'{"model": ', length=100))
        started = time.perf_counter()
        (status, headers, body), = _responses(sock, 1, timeout=BODY_TIMEOUT_S + 10)
        waited = time.perf_counter() - started
        assert status == 408 and headers["connection"] == "close", (status, headers)
        assert "did not arrive within 2 s" in json.loads(body)["error"]["message"]
        assert BODY_TIMEOUT_S - 0.5 < waited < BODY_TIMEOUT_S + 5, waited
        assert sock.recv(1) == b""  # closed
    # a client that sends its body in time, slowly, is served
    with socket.create_connection(("127.0.0.1", server_port(server)), timeout=30) as sock:
        body = json.dumps({"model": tiny_dirs[0], "prompt": "hi", "max_tokens": 2}).encode()
        sock.sendall(_request("POST", "/v1/completions", length=len(body)))
        for i in range(8):  # over 0.8 s of the 2 allowed
            sock.sendall(body[i * len(body) // 8:(i + 1) * len(body) // 8])
            time.sleep(0.1)
        (status, _, _), = _responses(sock, 1)
        assert status == 200


def test_an_idle_kept_alive_connection_is_closed(server):
    with socket.create_connection(("127.0.0.1", server_port(server)), timeout=30) as sock:
        sock.sendall(_request("GET", "/health"))
        (status, _, _), = _responses(sock, 1)
        assert status == 200
        started = time.perf_counter()
        assert select.select([sock], [], [], KEEP_ALIVE_S + 5)[0], "never closed"
        assert sock.recv(1) == b""
        assert time.perf_counter() - started < KEEP_ALIVE_S + 3


# -- temperature within each API's range; a refused CORS preflight in JSON -----------------


def test_temperature_is_bounded_as_each_api_bounds_it(server, tiny_dirs):
    model = tiny_dirs[0]
    chat = server.client()
    for temperature in (2.01, 1e30, -0.5):
        with pytest.raises(openai.BadRequestError) as error:
            chat.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2, temperature=temperature)
        assert error.value.body["param"] == "temperature"
        assert "temperature: must be between 0 and 2" in error.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            chat.completions.create(model=model, prompt="hi", max_tokens=2, temperature=temperature)
    assert chat.completions.create(model=model, prompt="hi", max_tokens=2, temperature=2).choices
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(model=model, max_tokens=2, extra_body={"temperature": 1.5},  # this
                               messages=[{"role": "user", "content": "hi"}])  # SDK has no argument
    assert "temperature: must be between 0 and 1" in error.value.body["error"]["message"]
    assert claude.messages.create(model=model, max_tokens=2, extra_body={"temperature": 1},
                                  messages=[{"role": "user", "content": "hi"}]).content is not None


def test_a_refused_cors_preflight_is_answered_in_json(tokenizer):
    origin = "http://localhost:3000"
    server = _in_process(tokenizer, cors_origins=(origin,))
    url = server.base.removesuffix("/v1")
    try:
        cases = [("/v1/chat/completions", "http://attacker.example", "POST", "origin"),
                 ("/v1/messages", "http://attacker.example", "POST", "origin"),
                 ("/v1/completions", origin, "PUT", "method")]
        for path, sender, method, refused in cases:
            response = httpx.options(url + path, headers={"Origin": sender,
                                                          "Access-Control-Request-Method": method})
            assert response.headers["content-type"] == "application/json", response.text
            if path.startswith("/v1/messages"):
                message = anthropic_error(response, 400, "invalid_request_error")
            else:
                message = assert_openai_error(response, 400)["message"]
            assert f"not allowed: {refused}" in message, message
            assert ("access-control-allow-origin" in response.headers) == (sender == origin)
        allowed = httpx.options(url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == origin
    finally:
        server.stop()
