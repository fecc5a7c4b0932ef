"""`mlx-spec serve` stopped by SIGTERM or SIGINT (Ctrl-C) mid-answer, in a real subprocess on
the tiny models: the running stream must end at once with an error event in OpenAI's shape
and `[DONE]`, requests waiting in the queue must be answered 503 (a streamed one with the
same error event), and the process must exit cleanly without a traceback."""

import json
import signal
import threading
import time

import httpx
import pytest
from server_support import LONG, Server, assert_openai_error, server_env, start_long_stream, wait_for

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache

GRACE_S = 5  # uvicorn's graceful-shutdown timeout in `mlx-spec serve`


def _events(lines) -> list:
    return [line[6:] for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_stream_with_an_error_and_answers_the_queue_503(sig, tiny_dirs, cost_cache):
    model = tiny_dirs[0]
    # one running, two waiting (a batch's running requests: tests/server/test_server_batch.py.py)
    server = Server(["--model", model, "--drafter", "none", "--parallel", 1, "--queue-size", 2],
                    server_env(cost_cache))
    queued: dict = {}

    def wait_plain():
        queued["plain"] = httpx.post(server.base + "/completions", timeout=60,
                                     json={"model": model, "prompt": "Hello", "max_tokens": 8})

    def wait_streamed():
        body = {"model": model, "prompt": "Hello", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", server.base + "/completions", json=body, timeout=60) as response:
            queued["streamed"] = (response.status_code, _events(response.iter_lines()))

    try:
        client, running, lines = start_long_stream(server, model)
        waiters = [threading.Thread(target=wait_plain), threading.Thread(target=wait_streamed)]
        for waiter in waiters:
            waiter.start()
        wait_for(lambda: server.health()["queued"] == 2, 10, "queued")
        assert server.health()["busy"]  # the long answer still generates
        signalled = time.monotonic()
        server.proc.send_signal(sig)
        rest = _events(lines)  # until the server ends the stream
        ended_s = time.monotonic() - signalled
        running.close()
        client.close()
        for waiter in waiters:
            waiter.join(30)
        code = server.proc.wait(30)
    finally:
        server.stop()

    # the running stream: an error event in OpenAI's shape, then [DONE], well inside the grace
    assert rest[-1] == "[DONE]", rest[-3:]
    error = json.loads(rest[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and "shutting down" in error["message"]
    pieces = [json.loads(event) for event in rest[:-2]]
    assert all(p["choices"][0]["finish_reason"] is None for p in pieces)  # cut, not finished
    assert len(pieces) < LONG
    assert ended_s < GRACE_S - 1, ended_s
    # the queue: 503 in OpenAI's shape, and the same error event on a stream
    assert_openai_error(queued["plain"], 503, "shutting down")
    status, events = queued["streamed"]
    assert status == 200 and events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    # a clean exit: 0 (SIGINT may also be 130), nothing cancelled mid-flight, no traceback
    assert code in ((0,) if sig == signal.SIGTERM else (0, 130)), (code, server.log)
    assert "Traceback" not in server.log and "CancelledError" not in server.log, server.log
