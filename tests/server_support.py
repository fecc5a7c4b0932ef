"""A live `mlx-spec serve` in a subprocess for the server tests: started as users start it
(`python -m mlx_spec.cli serve ... --port 0`), its stderr collected so tests can check that no
traceback was ever printed, stopped at the end."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time

import httpx

BANNER = re.compile(r"at (http://\S+)/v1")
# A greedy completion of this prompt by the tiny target (`cli_fixtures.tiny_dirs`) runs
# 4,000 tokens without an EOS (within its 4,096-token context): ~20 s on a 2-core CPU, so
# it still generates while a test acts (the tests check that it does).
LONG_PROMPT = "Tell me a story"
LONG = 4000


def server_env(cost_cache) -> dict:
    """The environment of a test's server: its private cost cache, tracebacks left to the log."""
    return {"MLX_SPEC_CACHE": str(cost_cache), "MLX_SPEC_DEBUG": ""}


def serving(args: list, env: dict | None = None, **kwargs):
    """A module fixture's body: `yield from serving([...], env)` starts a server, hands it to
    the tests, stops it and checks that it never printed a traceback."""
    server = Server(args, env, **kwargs)
    yield server
    server.stop()
    assert "Traceback" not in server.log, server.log


class Server:
    def __init__(self, args: list[str], env: dict | None = None, timeout: float = 90):
        command = [sys.executable, "-m", "mlx_spec.cli", "serve", "--port", "0", *map(str, args)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        lines: queue.Queue = queue.Queue()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        self.url = None
        while self.url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log}")
            match = BANNER.search(line)
            self.url = match.group(1) if match else None
        self.base = self.url + "/v1"
        self._wait_healthy(deadline)

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"the server never became healthy:\n{self.log}")

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float) -> dict:
        """/health once nothing generates or waits; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.health()
            if not state["busy"] and state["queued"] == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"still busy after {timeout} s: {state}")
            time.sleep(0.05)

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                      timeout=kwargs.pop("timeout", 60), **kwargs)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        """A raw POST: `body` as bytes is sent unchanged (malformed bodies), else as JSON."""
        payload = {"content": body} if isinstance(body, bytes) else {"json": body}
        return httpx.post(self.base + path, headers={"content-type": "application/json"},
                          timeout=kwargs.pop("timeout", 60), **payload, **kwargs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def assert_openai_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    """`status`, OpenAI's error shape, a one-line message holding `fragments`, no traceback."""
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert "\n" not in error["message"] and "Traceback" not in response.text
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """`status`, Anthropic's error shape with the error type `kind`, a one-line message
    (returned), no traceback."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and "\n" not in body["error"]["message"], body
    assert "Traceback" not in response.text
    return body["error"]["message"]


def start_long_stream(server: Server, model: str):
    """A streamed greedy completion of LONG tokens, read up to its first text. Returns
    (client, response, the iterator over its remaining lines); close both to leave."""
    client = httpx.Client(timeout=60)
    body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": LONG, "temperature": 0,
            "stream": True}
    response = client.send(client.build_request("POST", server.base + "/completions", json=body),
                           stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: {") and '"text": ""' not in line:
            break
    return client, response, lines



def server_port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def server_rss_mib(server) -> float:
    """The server process's resident memory, MiB (Linux)."""
    with open(f"/proc/{server.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")

def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.05)
