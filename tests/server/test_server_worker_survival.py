"""The generation thread cannot end silently (issue 46, items 1 and 2): keep-alive durations
longer than a thread can wait, any exception in the worker loop, and a worker that has died
or stalls, which `/health` must report (503) rather than "ok". Served in-process (so a test
can break the worker) on the tiny Gemma 3 target through the official `openai` client;
every answer is checked against mlx-lm's own greedy `generate`."""

import threading

import httpx
import pytest
from mlx_lm import generate, load

from mlx_spec.core.batch import Batch
from mlx_spec.core.engine import Engine
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.server import worker as worker_module
from mlx_spec.server.cache_pool import CachePool
from mlx_spec.server.worker import FOREVER, keep_alive_seconds
from scripted_model import InProcessServer
from server_support import assert_openai_error, wait_for

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

N = 6
PROMPT = "The committee met on a rainy Tuesday to discuss"


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load(tiny_dirs[0])


@pytest.fixture(scope="module")
def expected(target):
    model, tokenizer = target
    return generate(model, tokenizer, PROMPT, max_tokens=N)


def serve(target, **options) -> InProcessServer:
    model, tokenizer = target
    engine = Engine(model, None, eos_ids=tokenizer.eos_token_ids, context_length=4096)
    options = {"model_name": "tiny", "gamma": "0", "context_length": 4096, **options}
    # load: the same engine again, so keep-alive is live (and an unload cheap)
    return InProcessServer(create_app(engine, tokenizer, ServerOptions(**options), load=lambda: engine))


def health(server) -> httpx.Response:
    return httpx.get(server.base.removesuffix("/v1") + "/health", timeout=10)


def complete(server, timeout: float = 30, **extra):
    client = server.client().with_options(timeout=timeout)
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body=extra or None)


# -- 1. keep-alive past threading.TIMEOUT_MAX -----------------------------------------------

@pytest.mark.parametrize("value", [1e10, "3000000h", 9.3e9, "1e300"])
def test_a_keep_alive_longer_than_a_thread_can_wait_is_forever(value):
    assert keep_alive_seconds(value) == FOREVER
    assert keep_alive_seconds(threading.TIMEOUT_MAX / 2) == threading.TIMEOUT_MAX / 2


@pytest.mark.parametrize("where", ["request", "server"])
def test_a_huge_keep_alive_never_kills_the_worker(target, expected, where):
    """On the request (`"keep_alive": 1e10`) or the server's (`--keep-alive 3000000h`, as
    the flag's parser gave it before: 1.08e10 s): the idle wait after the answer raised
    OverflowError in the worker, and every later request waited forever."""
    server = serve(target, **({"keep_alive": 3000000 * 3600.0} if where == "server" else {}))
    try:
        extra = {"keep_alive": 1e10} if where == "request" else {}
        assert complete(server, **extra).choices[0].text == expected
        assert complete(server, timeout=20).choices[0].text == expected  # the worker is alive
        assert health(server).json()["status"] == "ok"
    finally:
        server.stop()


# -- 2. the worker loop survives any exception ------------------------------------------------

def test_the_worker_survives_an_error_outside_any_job(target, expected, monkeypatch):
    """An exception from the batch itself (not one job's generation, which `_serve`
    catches) failed nobody and ended the thread: that request and every later one hung.
    Now it fails the running request with a 500 in OpenAI's shape and the next is served."""
    step = Batch.step
    broken = {"left": 1}

    def fails_once(self):
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("a shared forward failed\nwith a second line")
        return step(self)

    monkeypatch.setattr(Batch, "step", fails_once)
    server = serve(target)
    try:
        response = httpx.post(server.base + "/completions", timeout=30,
                              json={"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0})
        assert_openai_error(response, 500, "internal error during generation (RuntimeError)")
        assert complete(server, timeout=20).choices[0].text == expected
        status = health(server)
        assert status.status_code == 200 and status.json()["worker_errors"] == 1
        assert status.json()["failed"] == 1 and status.json()["running"] == 0
    finally:
        server.stop()


def test_a_pool_that_raises_while_fitting_fails_one_request_only(target, expected, monkeypatch):
    """`CachePool.fit` runs in `_serve`'s `finally`: what it raised escaped the job and
    ended the thread. The answer was already sent; the next request must be served."""
    fit = CachePool.fit
    broken = {"left": 1}

    def fails_once(self, *args, **kwargs):
        if broken["left"]:
            broken["left"] -= 1
            raise OSError(28, "No space left on device")
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(CachePool, "fit", fails_once)
    server = serve(target)
    try:
        assert complete(server).choices[0].text == expected
        assert complete(server, timeout=20).choices[0].text == expected
        assert health(server).json()["worker_errors"] == 1
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_a_dead_worker(target, expected, monkeypatch):
    """A worker thread that has ended (here by what no loop may catch, SystemExit) made
    /health answer "ok" while every request waited forever: now 503, "unhealthy"."""
    server = serve(target)
    try:
        worker = _worker_of(server)

        def exits(*args, **kwargs):
            raise SystemExit("gone")

        # the worker waits inside `_next_job` now: the next call, after this answer, exits
        monkeypatch.setattr(worker, "_next_job", exits)
        assert complete(server).choices[0].text == expected
        wait_for(lambda: not worker._thread.is_alive(), 10, "the thread ended")
        status = health(server)
        assert status.status_code == 503, status.text
        assert status.json()["status"] == "unhealthy" and "ended" in status.json()["problem"]
    finally:
        server.stop()


def test_health_reports_a_stuck_worker(target, expected, monkeypatch):
    """A running job that makes no progress (a generation blocked inside the device, here
    a stream that waits on an event) makes /health 503 once `stuck_after` has passed."""
    release = threading.Event()
    stream = worker_module.stream_request

    def blocked(*args, **kwargs):
        release.wait(30)
        yield from stream(*args, **kwargs)

    monkeypatch.setattr(worker_module, "stream_request", blocked)
    server = serve(target)
    worker = _worker_of(server)
    worker.stuck_after = 0.5
    answer = {}
    client = threading.Thread(target=lambda: answer.update(result=complete(server)))
    client.start()
    try:
        wait_for(lambda: health(server).status_code == 503, 10, "reported stuck")
        assert "no progress" in health(server).json()["problem"]
        release.set()
        client.join(30)
        assert answer["result"].choices[0].text == expected
        assert health(server).status_code == 200
    finally:
        release.set()
        server.stop()


def _worker_of(server):
    return server.server.config.app.state.worker
