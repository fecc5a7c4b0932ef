"""`mlx-spec serve` against hostile and careless clients (issue 18; issue 20's system-only
conversation): queued clients that leave, deeply nested JSON, non-ASCII keys, rebinding
Host headers, cross-origin text/plain POSTs, huge and chunked bodies, thousands of stop
strings, fields that would change the answer. Each is driven against a live server in a
subprocess: the official `openai` client where a client is involved, raw HTTP (httpx or a
socket) for what no client sends. References: mlx-lm's own `generate` and chat template."""

import json
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from mlx_lm import generate, load
from server_support import (
    LONG_PROMPT,
    Server,
    anthropic_error,
    assert_openai_error,
    server_env,
    server_port,
    server_rss_mib,
    serving,
    start_long_stream,
    wait_for,
)

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache

@pytest.fixture(scope="module")
def env(cost_cache):
    return server_env(cost_cache)


@pytest.fixture(scope="module")
def server(tiny_dirs, env):
    """Plain decoding, one request at a time, one place in the queue."""
    yield from serving(["--model", tiny_dirs[0], "--drafter", "none", "--parallel", 1, "--queue-size", 1], env)


@pytest.fixture(scope="module")
def keyed_server(tiny_dirs, env):
    yield from serving(["--model", tiny_dirs[0], "--drafter", "none", "--api-key", "sekret"], env)


@pytest.fixture(scope="module")
def mlx_lm_target(tiny_dirs):
    return load(tiny_dirs[0])




# -- 1. a client that leaves the queue frees its place ------------------------------------


def test_a_queued_client_that_leaves_frees_its_place(server, tiny_dirs):
    model = tiny_dirs[0]
    server.wait_idle(30)
    client, running, _ = start_long_stream(server, model)
    try:
        def leave_while_queued():
            try:
                httpx.post(server.base + "/completions", timeout=3,
                           json={"model": model, "prompt": "Hello", "max_tokens": 8})
            except httpx.ReadTimeout:
                pass

        leaver = threading.Thread(target=leave_while_queued)
        leaver.start()
        wait_for(lambda: server.health()["queued"] == 1, 5, "queued")
        leaver.join()
        wait_for(lambda: server.health()["queued"] == 0, 3, "freed")
        assert server.health()["busy"]  # the long answer still runs
        answer = {}
        waiter = threading.Thread(target=lambda: answer.update(result=server.client().completions.create(
            model=model, prompt="Hello", max_tokens=4, temperature=0)))
        waiter.start()
        wait_for(lambda: server.health()["queued"] == 1 or not waiter.is_alive(), 5, "queued")
        assert waiter.is_alive(), "the next client was refused although the queue had room"
    finally:
        running.close()
        client.close()
    waiter.join(60)
    assert answer["result"].usage.completion_tokens >= 1
    assert server.wait_idle(30)["cancelled"] >= 2  # the leaver and the long stream


def test_a_full_queue_refuses_before_tokenizing(server, tiny_dirs):
    """Issue 33, item 8: prompts were tokenized before the queue-full check. Here each
    request is one only tokenizing could refuse (a prompt whose characters fit the context
    but whose tokens do not; a system turn the template leaves out): while the queue is
    full they get 503 with Retry-After, not their 400, so none was tokenized."""
    model = tiny_dirs[0]
    huge = "x" * 60_000  # 60,000 tokens for this tokenizer, under the 4,096 × 15 bytes bound
    refused = [("/completions", {"model": model, "prompt": huge, "max_tokens": 2}),
               ("/chat/completions", {"model": model, "max_tokens": 2,
                                      "messages": [{"role": "system", "content": "Be brief."}]}),
               ("/messages", {"model": model, "max_tokens": 2,
                              "messages": [{"role": "user", "content": huge}]})]
    server.wait_idle(30)
    client, running, _ = start_long_stream(server, model)
    answer = {}
    try:
        waiter = threading.Thread(target=lambda: answer.update(result=server.client().completions.create(
            model=model, prompt="Hello", max_tokens=2)))
        waiter.start()
        wait_for(lambda: server.health()["queued"] == 1, 5, "queued")  # the queue (1) is full
        for path, body in refused:
            response = server.post(path, body)
            if path == "/messages":
                assert "busy" in anthropic_error(response, 503, "overloaded_error")
            else:
                assert assert_openai_error(response, 503, "busy")["code"] == "server_busy"
            assert int(response.headers["retry-after"]) >= 1
        # what is wrong without tokens still gets its 400 first
        assert_openai_error(server.post("/completions", {"model": model, "prompt": huge, "top_p": 7}),
                            400, "top-p")
        # counting tokens queues nothing: answered while the queue is full
        count = server.post("/messages/count_tokens", {"model": model, "messages": [
            {"role": "user", "content": huge}]})
        assert count.status_code == 200 and count.json()["input_tokens"] > 60_000
    finally:
        running.close()
        client.close()
    waiter.join(60)
    assert answer["result"].choices
    server.wait_idle(30)
    for path, body in refused:  # with room, each is tokenized and gets its own answer
        assert server.post(path, body).status_code == 400


# -- 2. deeply nested JSON ----------------------------------------------------------------


@pytest.mark.parametrize("depth", [100, 5000, 100_000])
def test_deeply_nested_json_is_a_400(server, tiny_dirs, depth):
    bodies = [b"[" * depth + b"]" * depth,
              b'{"a":' * depth + b"1" + b"}" * depth,
              b'{"model": "%s", "prompt": "hi", "extra": ' % tiny_dirs[0].encode()
              + b"[" * depth + b"]" * depth + b"}"]
    for body in bodies:
        assert_openai_error(server.post("/completions", body), 400, "nested deeper than 64")
    ok = server.client().completions.create(model=tiny_dirs[0], prompt="hi", max_tokens=2)
    assert ok.choices and server.health()["failed"] == 0


@pytest.mark.parametrize("body,kind", [(b"null", "null"), (b"12", "a number"), (b'"hi"', "a string"),
                                       (b"[]", "a list"), (b"true", "true")])
def test_a_body_that_is_not_an_object_is_a_400_in_the_routes_shape(server, body, kind):
    """Issue 33, item 17: `null` was told it was nested deeper than 64 levels."""
    said = f"the request body must be a JSON object, not {kind}"
    for path in ("/completions", "/chat/completions"):
        assert assert_openai_error(server.post(path, body), 400, said)["message"] == said
    for path in ("/messages", "/messages/count_tokens"):
        assert anthropic_error(server.post(path, body), 400, "invalid_request_error") == said


# -- 3. the API key: bytes, and an unusable key refused at start-up -----------------------


def test_a_non_ascii_bearer_token_is_a_401(keyed_server, tiny_dirs):
    url = keyed_server.base + "/models"
    for token in [b"Bearer \xe9", b"Bearer sekret\xe9", b"\xe9\xe9 sekret", b"Bearer \xff\xfe"]:
        response = httpx.get(url, headers=[(b"Authorization", token)])
        assert_openai_error(response, 401, "API key")
    for headers in [{"x-api-key": "wrong"}, [(b"x-api-key", b"sekret\xe9")], {"Authorization": "sekret"}]:
        assert_openai_error(httpx.get(url, headers=headers), 401, "API key")
    assert httpx.get(url, headers={"x-api-key": "sekret"}).status_code == 200  # Anthropic's header
    assert httpx.get(keyed_server.url + "/health").status_code == 200  # probes need no key
    assert_openai_error(httpx.get(keyed_server.url + "/elsewhere"), 401)  # every other path does
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client(api_key="wrong").models.list()
    keyed = keyed_server.client(api_key="sekret")
    assert keyed.completions.create(model=tiny_dirs[0], prompt="hi", max_tokens=2).choices


def test_options_needs_the_key_like_any_other_method(keyed_server):
    """Issue 33, item 11: OPTIONS skipped the key on every path. CORS preflights never reach
    the guards (CORSMiddleware answers them, tests/server/test_server_guarded_agents.py)."""
    for path in ("/v1/models", "/v1/chat/completions", "/metrics", "/elsewhere"):
        assert_openai_error(httpx.options(keyed_server.url + path), 401, "API key")
        assert_openai_error(httpx.options(keyed_server.url + path, headers={
            "Origin": "http://attacker.example", "Access-Control-Request-Method": "POST"}), 401)
        keyed = httpx.options(keyed_server.url + path, headers={"x-api-key": "sekret"})
        assert_openai_error(keyed, 404 if path == "/elsewhere" else 405)  # no route answers OPTIONS
    messages = httpx.options(keyed_server.url + "/v1/messages")
    anthropic_error(messages, 401, "authentication_error")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_unusable_api_key_is_refused_at_start(tiny_dirs, env, how):
    # (an empty MLX_SPEC_API_KEY counts as unset, as Click reads empty variables)
    for key in ["clé", "two words"] + ([""] if how == "flag" else []):
        args = [sys.executable, "-m", "mlx_spec.cli", "serve", "--model", tiny_dirs[0],
                "--drafter", "none", "--port", "0"]
        extra = {"MLX_SPEC_API_KEY": key} if how == "env" else {}
        result = subprocess.run(args + (["--api-key", key] if how == "flag" else []),
                                capture_output=True, text=True, timeout=30,
                                env={**__import__("os").environ, **env, **extra})
        assert result.returncode == 2, result.stderr  # a usage error
        lines = result.stderr.strip().splitlines()
        assert lines[0].startswith("error: --api-key") and "printable ASCII" in lines[0], lines
        assert "Traceback" not in result.stderr


# -- 5. stop strings are bounded ----------------------------------------------------------


def test_stop_strings_are_bounded_in_count_and_length(server, tiny_dirs):
    client = server.client()
    ask = dict(model=tiny_dirs[0], prompt=LONG_PROMPT, max_tokens=300, temperature=0)
    for stop, fragment in [(["x" * 1000] * 1000, "at most 4 stop strings"),
                           ([f"#{i}#" for i in range(5)], "at most 4 stop strings"),
                           (["y" * 257], "at most 256 characters")]:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as error:
                client.completions.create(**ask, stop=stop, stream=stream)
            assert fragment in error.value.body["message"] and error.value.body["param"] == "stop"
    # four of the longest allowed, none of which occurs, cost little and change nothing
    started = time.perf_counter()
    plain = client.completions.create(**ask)
    plain_s = time.perf_counter() - started
    started = time.perf_counter()
    stopped = client.completions.create(**ask, stop=[c * 256 for c in "#%&~"])
    stopped_s = time.perf_counter() - started
    assert stopped.choices[0].text == plain.choices[0].text and stopped.usage.completion_tokens == 300
    assert stopped_s < 3 * plain_s + 2, (stopped_s, plain_s)  # loose: the machine is shared


# -- 6. big bodies: refused while reading, off the event loop, memory returned -------------


def _raw_post(server, head_extra: bytes, chunks, timeout: float = 30) -> tuple[int, bytes]:
    """POST /v1/completions over a socket, sending `chunks` one by one and watching for an
    early answer after each (a server that refuses a body answers before it is all sent)."""
    sock = socket.create_connection(("127.0.0.1", server_port(server)), timeout=timeout)
    answer = b""
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n" + head_extra + b"\r\n")
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # until the server closes (it says Connection: close)
            if select.select([sock], [], [], 0.5)[0]:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    break
                if not data:
                    break
                answer += data
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split()[1]), answer


def test_a_huge_chunked_body_is_refused_while_it_arrives(server):
    server.wait_idle(30)
    before = server_rss_mib(server)
    piece = b"x" * 65536
    sent = [0]

    def chunks():  # 64 MiB in chunked encoding
        for _ in range(1024):
            sent[0] += len(piece)
            yield b"%x\r\n%s\r\n" % (len(piece), piece)
        yield b"0\r\n\r\n"

    status, answer = _raw_post(server, b"Transfer-Encoding: chunked\r\n", chunks())
    assert status == 413 and b"larger than 16 MiB" in answer
    assert sent[0] < 40 * 2**20, f"the whole body was read ({sent[0] >> 20} MiB sent)"
    assert server_rss_mib(server) - before < 48, (before, server_rss_mib(server))
    # a declared length over the limit is refused before any of the body is read
    status, answer = _raw_post(server, b"Content-Length: 104857600\r\n", [b"{"], timeout=10)
    assert status == 413
    assert server.health()["status"] == "ok"


def test_a_10_mb_message_is_refused_at_once_and_memory_returns(server, tiny_dirs):
    model = tiny_dirs[0]
    server.wait_idle(30)
    client = server.client(timeout=60)
    client.completions.create(model=model, prompt="warm", max_tokens=2)
    before = server_rss_mib(server)
    results, health_s = [], []

    def big(i):
        try:
            if i % 2:
                client.chat.completions.create(model=model, messages=[
                    {"role": "user", "content": "x" * 10_000_000}], max_tokens=2)
            else:
                client.completions.create(model=model, prompt="y" * 10_000_000, max_tokens=2)
        except openai.BadRequestError as error:
            results.append(error.body)

    threads = [threading.Thread(target=big, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        started = time.perf_counter()
        assert server.health()["status"] == "ok"
        health_s.append(time.perf_counter() - started)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r["code"] == "context_length_exceeded" for r in results)
    assert "needs at least" in results[0]["message"]
    assert max(health_s) < 2.0, health_s  # /health was never stuck behind tokenizing
    time.sleep(0.5)
    after = server_rss_mib(server)
    assert after - before < 64, (before, after)  # four 10 MB bodies; +400 MiB before the fix


# -- 7. web pages: Host, content type, CORS -----------------------------------------------


def test_rebinding_host_names_are_refused(server, tiny_dirs):
    port = server_port(server)
    for host in ["attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io",
                 "localhost.attacker.example", "models.example.test"]:
        response = httpx.get(server.url + "/health", headers={"Host": host})
        assert_openai_error(response, 403, "is not served here", "--allowed-hosts")
        response = httpx.post(server.base + "/completions", headers={"Host": host},
                              json={"model": tiny_dirs[0], "prompt": "hi", "max_tokens": 2})
        assert_openai_error(response, 403)
    for host in ["localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}",
                 f"[::1]:{port}", "127.0.0.2", "LOCALHOST."]:
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200, host


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def _this_machine() -> list[str]:
    """Names and addresses other machines reach this one by: its host names, what they
    resolve to, and the address it sends from by default (a UDP connect sends nothing)."""
    names = [socket.gethostname(), socket.getfqdn()]
    for name in list(names):
        names += [info[4][0] for info in socket.getaddrinfo(name, None)]
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as udp:
                udp.connect((probe, 9))
                names.append(udp.getsockname()[0])
        except OSError:
            pass
    return names


def _status(server, host: str, address: str) -> int:
    """GET /health over a connection to `address` with `Host: host`."""
    url = f"http://{address}:{server_port(server)}/health"
    return httpx.get(url, headers={"Host": host}, timeout=10).status_code


@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
def test_a_public_host_answers_this_machines_names_only(tiny_dirs, env, bind):
    """Issue 33, item 7: with --host 0.0.0.0 the Host check was off, so a page that rebinds
    its name to this machine's address could drive the model from the user's browser."""
    if bind == "::" and not _ipv6():
        pytest.skip("no IPv6 on this machine")
    server = Server(["--model", tiny_dirs[0], "--drafter", "none", "--host", bind], env)
    try:
        port, loopback = server_port(server), "127.0.0.1" if bind == "0.0.0.0" else "[::1]"
        shown = bind if bind == "0.0.0.0" else f"[{bind}]"
        served = [f"{shown}:{port}", "localhost", f"127.0.0.1:{port}", f"[::1]:{port}",
                  f"{socket.gethostname().upper()}:{port}"]
        served += [f"[{name}]" if ":" in name else name for name in _this_machine()]
        for host in served:
            assert _status(server, host, loopback) == 200, host
        for host in ["attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io",
                     f"{socket.gethostname()}.attacker.example"]:
            response = httpx.get(f"http://{loopback}:{port}/health", headers={"Host": host}, timeout=10)
            assert_openai_error(response, 403, "is not served here", "--allowed-hosts")
    finally:
        server.stop()
    assert "Traceback" not in server.log


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
def test_allowed_hosts_adds_names(tiny_dirs, env, bind):
    server = Server(["--model", tiny_dirs[0], "--drafter", "none", "--host", bind,
                     "--allowed-hosts", "models.example.test, other.example.test"], env)
    try:
        port = server_port(server)
        cases = [(f"models.example.test:{port}", 200), ("other.example.test", 200),
                 ("localhost", 200), ("attacker.example", 403)]
        if bind == "0.0.0.0":  # this machine's own names are still answered
            cases.append((socket.gethostname(), 200))
        for host, status in cases:
            assert _status(server, host, "127.0.0.1") == status, host
    finally:
        server.stop()
    assert "Traceback" not in server.log


def test_allowed_hosts_star_turns_the_check_off(tiny_dirs, env):
    server = Server(["--model", tiny_dirs[0], "--drafter", "none", "--host", "0.0.0.0",
                     "--allowed-hosts", "*"], env)
    try:
        for host in ["attacker.example", "127.0.0.1.nip.io:80"]:
            assert _status(server, host, "127.0.0.1") == 200, host
    finally:
        server.stop()
    assert "Traceback" not in server.log


def test_only_json_bodies_are_read_and_no_cors_headers_are_sent(server, tiny_dirs):
    body = json.dumps({"model": tiny_dirs[0], "prompt": "hi", "max_tokens": 2})
    origin = {"Origin": "http://attacker.example"}
    for kind in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 None]:
        headers = {**origin, **({"Content-Type": kind} if kind else {})}
        response = httpx.post(server.base + "/completions", content=body.encode(), headers=headers)
        assert_openai_error(response, 415, "application/json")
        assert not [h for h in response.headers if h.lower().startswith("access-control-")]
    fine = httpx.post(server.base + "/completions", content=body.encode(),
                      headers={**origin, "Content-Type": "application/json; charset=utf-8"})
    assert fine.status_code == 200
    preflight = httpx.options(server.base + "/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    for response in (fine, preflight, httpx.get(server.base + "/models", headers=origin)):
        assert not [h for h in response.headers if h.lower().startswith("access-control-")]


# -- 8. fields that change meaning are refused; a one-prompt list is accepted -------------


def test_fields_that_change_the_answer_are_refused(server, tiny_dirs):
    client = server.client()
    model = tiny_dirs[0]
    chat = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    refusals = [
        (client.chat.completions.create, chat, dict(functions=[{"name": "f", "parameters": {}}]), "functions"),
        (client.chat.completions.create, chat, dict(logit_bias={"50": 100}), "logit_bias"),
        (client.chat.completions.create, chat, dict(stream_options={"include_usage": True}), "stream_options"),
    ]
    plain = dict(model=model, prompt="Hi", max_tokens=2)
    refusals += [(client.completions.create, plain, dict(echo=True, stream=True), "echo"),  # served whole only
                 (client.completions.create, plain, dict(best_of=2), "best_of"),
                 (client.completions.create, plain, dict(suffix="end"), "suffix"),
                 (client.completions.create, plain, dict(logit_bias={"50": -100}), "logit_bias"),
                 (client.completions.create, plain, dict(stream_options={"include_usage": True}),
                  "stream_options")]
    for create, base, extra, param in refusals:
        with pytest.raises(openai.BadRequestError) as error:
            create(**base, **extra)
        assert error.value.body["code"] == "unsupported_parameter", error.value.body
        assert error.value.body["param"] == param
    # their no-op values are fine
    assert client.chat.completions.create(**chat, logit_bias={}, response_format={"type": "text"},
                                          stream=False).choices
    assert client.completions.create(**plain, echo=False, best_of=1, suffix="").choices
    # issue 34: JSON response formats are served (constrained), cut values say "length"
    for response_format in (schema, {"type": "json_object"}):
        assert client.chat.completions.create(**chat, response_format=response_format).choices[0].finish_reason == "length"
    assert server.health()["failed"] == 0


@pytest.mark.parametrize("value, message", [
    (b"Infinity", "Infinity is not a JSON number"), (b"-Infinity", "-Infinity is not a JSON number"),
    (b"NaN", "NaN is not a JSON number"),
    (b"1e999", "repetition penalty must be > 0 and finite"),  # JSON, but past a float: inf
])
def test_non_finite_numbers_are_refused(server, tiny_dirs, value, message):
    body = b'{"model": "%s", "prompt": "hi", "repetition_penalty": %s}' % (tiny_dirs[0].encode(), value)
    assert_openai_error(server.post("/completions", body), 400, message)


def test_a_list_of_one_prompt_is_accepted(server, tiny_dirs, mlx_lm_target):
    client = server.client()
    model, tokenizer = mlx_lm_target
    listed = client.completions.create(model=tiny_dirs[0], prompt=["Hello there"], max_tokens=16,
                                       temperature=0)
    assert listed.choices[0].text == generate(model, tokenizer, "Hello there", max_tokens=16)
    ids = tokenizer.encode("Hello there")
    assert client.completions.create(model=tiny_dirs[0], prompt=[ids], max_tokens=16,
                                     temperature=0).choices[0].text == listed.choices[0].text
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=tiny_dirs[0], prompt=["one", "two"], max_tokens=2)
    assert "only one prompt" in error.value.body["message"]


# -- issue 20, item 8: a system-only conversation is not silently dropped -----------------


def test_a_system_only_conversation_is_refused_and_a_system_turn_kept(server, tiny_dirs, mlx_lm_target):
    client = server.client()
    _, tokenizer = mlx_lm_target
    system = {"role": "system", "content": "You are a pirate."}
    for messages in ([system], [{"role": "developer", "content": "You are a pirate."}]):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=tiny_dirs[0], messages=messages, max_tokens=2)
        assert error.value.body["param"] == "messages[0]"
        assert "needs a user message" in error.value.body["message"]
    # with a user turn the template keeps it (Gemma's puts it into that turn): all of it is read
    messages = [system, {"role": "user", "content": "Hi"}]
    answer = client.chat.completions.create(model=tiny_dirs[0], messages=messages, max_tokens=2)
    reference = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert answer.usage.prompt_tokens == len(reference)
    assert "You are a pirate." in tokenizer.decode(reference)
