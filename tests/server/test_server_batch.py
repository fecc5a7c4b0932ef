"""`serve --parallel N`: up to N requests decode together (issue 28), each exact as if alone.

The worker runs in-process on the tiny Gemma 3 pair (sliding window 16) with a draft model;
its jobs are submitted as the HTTP routes submit them. References: mlx-lm's own greedy
decoding for every answer, and for a seeded sampled answer the same job on a serial worker
(`--parallel 1`, today's path). A job that fails, is cancelled or is refused ends alone;
the others' tokens do not change. Last, one live server through the official client: the
answers' `mlx_spec.batch_size` and `/metrics`' batch counters.
"""

import threading

import httpx
import openai
import pytest
from conftest import greedy_reference, recorded_verify_passes
from mlx_lm import generate
from prometheus_client.parser import text_string_to_metric_families
from server_support import Server, server_env
from trees_support import BRANCHING_PROMPT
from worker_support import make_worker, pair, run_jobs  # noqa: F401  (pair: a fixture)

from mlx_spec.core.cache.sequence import SequenceCache
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.drafters import NgramDrafter
from mlx_spec.server.worker import Done, Failed, Worker

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache

PROMPTS = [
    [2, 40, 41, 42, 43, 44, 45, 40, 41],
    [2] + [(7 * i) % 250 + 6 for i in range(30)],  # longer than the window
    [2, 9, 8, 7],
    [2] + [40, 41, 42, 43] * 5,
]
LENGTHS = [24, 30, 20, 28]  # every answer crosses the window


def reference(pair, prompt, max_tokens):
    target, _, tokenizer = pair
    tokens = greedy_reference(target, prompt, max_tokens)
    cut = next((i + 1 for i, t in enumerate(tokens) if t in tokenizer.eos_token_ids), len(tokens))
    return tokens[:cut]


class Faulty(str):
    """A stop "string" whose search fails: the job fails at its first round's stop check,
    mid-batch, as a parser error would."""

    def __bool__(self):
        return True

    def __len__(self):
        raise RuntimeError("a fault inside one request")


def test_jobs_decoded_together_each_answer_as_alone(pair):
    sampled = SamplingParams(temperature=1.0, seed=7)
    specs = [{"prompt": p, "max_tokens": n} for p, n in zip(PROMPTS, LENGTHS)]
    specs[2]["params"] = sampled
    results = run_jobs(make_worker(pair, parallel=4), specs)
    for spec, (tokens, done) in zip(specs, results):
        assert isinstance(done, Done) and done.batch_size == 4
        if spec.get("params") is None:
            assert tokens == reference(pair, spec["prompt"], spec["max_tokens"])
    assert results[0][1].stats.accepted > 0  # it drafted, and drafts were kept
    # the seeded sampled answer is the one a serial worker gives it
    alone = run_jobs(make_worker(pair, parallel=1), [specs[2]])[0]
    assert results[2][0] == alone[0] and alone[1].batch_size == 1


def test_a_job_alone_on_a_batching_worker_runs_as_on_a_serial_one(pair, private_cost_cache, monkeypatch):
    """One client of `--parallel 4` gets the serial worker's speed-ups: at γ 0 the same
    passes (every plain round pipelined), under `--gamma tree` draft trees; each answer
    is mlx-lm's."""
    passes = recorded_verify_passes(monkeypatch)
    spec = {"prompt": PROMPTS[1], "max_tokens": LENGTHS[1]}
    seen = []
    for parallel in (1, 4):
        tokens, done = run_jobs(make_worker(pair, parallel=parallel, gamma="0"), [spec])[0]
        assert isinstance(done, Done) and done.batch_size == 1
        assert tokens == reference(pair, PROMPTS[1], LENGTHS[1])
        seen.append(list(passes))
        passes[:] = []
    assert seen[0] == seen[1] and sum(queued for queued, _ in seen[1]) > LENGTHS[1] // 2

    target, _, tokenizer = pair  # n-gram drafts cost nothing: trees pay
    worker = Worker(Engine(target, NgramDrafter(), eos_ids=tokenizer.eos_token_ids), tokenizer, gamma="tree",
                    parallel=4, cache_budget=2**28)
    tokens, done = run_jobs(worker, [{"prompt": BRANCHING_PROMPT, "max_tokens": 30}])[0]
    assert tokens == reference(pair, BRANCHING_PROMPT, 30)
    assert any(tree for _, tree in passes)


def test_constrained_jobs_in_a_batch_answer_as_alone(pair):
    """Structured output in a batch (issue 34 with 28): each row is masked by its own grammar
    (or none), its tokens those it gets alone, a finished JSON value valid."""
    import json

    from mlx_spec.core.grammar import compile_grammar

    tokenizer = pair[2]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "kind": {"enum": ["ab", "cde"]}},
              "required": ["n", "kind"], "additionalProperties": False}
    grammars = [compile_grammar(tokenizer, "json_schema", json.dumps(schema), tokenizer.eos_token_ids), None,
                compile_grammar(tokenizer, "regex", "[a-z]{3,12}", tokenizer.eos_token_ids)]
    specs = [{"prompt": p, "max_tokens": n, "grammar": g} for p, n, g in zip(PROMPTS, LENGTHS, grammars)]
    together = run_jobs(make_worker(pair, parallel=4), specs)
    for spec, (tokens, done) in zip(specs, together):
        assert isinstance(done, Done) and done.batch_size == 3
        alone = run_jobs(make_worker(pair, parallel=1), [spec])[0]
        assert tokens == alone[0] and alone[1].batch_size == 1
    text = tokenizer.decode([t for t in together[0][0] if t not in tokenizer.eos_token_ids])
    if together[0][1].finish_reason == "stop":
        value = json.loads(text)
        assert set(value) == {"n", "kind"} and value["kind"] in ("ab", "cde")
    assert tokens != together[1][0]  # the rows differ: the masks are the rows' own


def test_a_job_that_fails_mid_batch_ends_alone(pair):
    specs = [{"prompt": PROMPTS[0], "max_tokens": 24}, {"prompt": PROMPTS[1], "max_tokens": 30, "stop": (Faulty("x"),)},
             {"prompt": PROMPTS[3], "max_tokens": 28}]
    results = run_jobs(make_worker(pair, parallel=4), specs)
    assert isinstance(results[1][1], Failed) and results[1][1].status == 500
    assert "\n" not in results[1][1].message
    for i in (0, 2):
        assert results[i][0] == reference(pair, specs[i]["prompt"], specs[i]["max_tokens"])
        assert results[i][1].batch_size == 3


def test_cancelling_one_job_leaves_the_others_tokens_unchanged(pair):
    def cancel_the_first(jobs, job, event):
        if job is jobs[0]:
            job.cancelled.set()  # as the route does when its client goes away

    specs = [{"prompt": PROMPTS[1], "max_tokens": 200}, {"prompt": PROMPTS[0], "max_tokens": 24},
             {"prompt": PROMPTS[2], "max_tokens": 20}]
    results = run_jobs(make_worker(pair, parallel=4), specs, act=cancel_the_first)
    assert results[0][1].finish_reason is None and len(results[0][0]) < 200
    for i in (1, 2):
        assert results[i][0] == reference(pair, specs[i]["prompt"], specs[i]["max_tokens"])


def test_a_job_past_the_context_is_refused_before_it_joins(pair):
    specs = [{"prompt": PROMPTS[0], "max_tokens": 24}, {"prompt": list(range(2, 70)), "max_tokens": 8},
             {"prompt": PROMPTS[3], "max_tokens": 28}]
    results = run_jobs(make_worker(pair, parallel=4, context_length=64), specs)
    assert isinstance(results[1][1], Failed) and results[1][1].status == 400
    assert "context" in results[1][1].message
    for i in (0, 2):
        assert results[i][0] == reference(pair, specs[i]["prompt"], specs[i]["max_tokens"])
        assert results[i][1].batch_size == 2  # the refused one never took a row


def test_served_answers_say_their_batch_size_and_metrics_count_the_batch(tiny_dirs, cost_cache, pair):
    target, draft = tiny_dirs
    server = Server(["--model", target, "--draft-model", draft, "--gamma", "2", "--parallel", "4"],
                    server_env(cost_cache))
    try:
        client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=120)
        answers = [None] * 3

        def ask(i):
            answers[i] = client.completions.create(model=target, prompt=PROMPTS[i], max_tokens=40, temperature=0)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        model, _, tokenizer = pair
        sizes = [answer.model_extra["mlx_spec"]["batch_size"] for answer in answers]
        assert max(sizes) > 1, sizes  # three at once: some shared a forward
        for i, answer in enumerate(answers):
            assert answer.choices[0].text == generate(model, tokenizer, PROMPTS[i], max_tokens=40)
        text = httpx.get(server.base.removesuffix("/v1") + "/metrics", timeout=10).text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["mlx_spec_parallel"] == 4 and samples["mlx_spec_running"] == 0
        assert samples["mlx_spec_batch_rows_total"] > samples["mlx_spec_batch_forwards_total"] > 0
    finally:
        server.stop()
    assert "Traceback" not in server.log, server.log


def test_shutting_down_ends_every_running_job_and_answers_the_queue_503(pair):
    worker = make_worker(pair, parallel=2)

    def shut_down_at_the_first_text(jobs, job, event):
        worker.shut_down()  # as SIGTERM does; a no-op once it has begun

    specs = [{"prompt": PROMPTS[i], "max_tokens": 200} for i in range(3)]
    results = run_jobs(worker, specs, act=shut_down_at_the_first_text)
    for tokens, last in results:  # the two running and the one waiting alike
        assert isinstance(last, Failed) and last.status == 503 and "shutting down" in last.message
    assert all(len(tokens) < 200 for tokens, _ in results)


def test_a_fault_in_the_shared_forward_fails_its_jobs_alone_and_the_worker_goes_on(pair, monkeypatch):
    import mlx_spec.core.batch as batch_module

    real, calls = batch_module.run_passes, []

    def failing_third(passes):
        calls.append(len(passes))
        if len(calls) == 3:
            raise RuntimeError("the device failed")
        return real(passes)

    monkeypatch.setattr(batch_module, "run_passes", failing_third)
    specs = [{"prompt": PROMPTS[0], "max_tokens": 24}, {"prompt": PROMPTS[1], "max_tokens": 30},
             {"prompt": PROMPTS[3], "max_tokens": 28}]  # the third waits for a place
    results = run_jobs(make_worker(pair, parallel=2), specs)
    for tokens, last in results[:2]:
        assert isinstance(last, Failed) and last.status == 500 and "RuntimeError" in last.message
    assert results[2][0] == reference(pair, specs[2]["prompt"], specs[2]["max_tokens"])
    assert calls[2] == 2  # the failed forward held both running jobs


def test_a_request_that_ends_first_never_evicts_a_running_ones_cache(pair, tmp_path, monkeypatch):
    """With a one-byte budget every finished request evicts what it may. The long request
    takes its cache first (the least recent); the short one ends while it still decodes:
    the long one's cache must stay in the pool, unwritten, and hold its whole conversation
    once it ends."""
    from mlx_spec.server.disk_caches import DiskCaches

    worker = make_worker(pair, parallel=2, cache_budget=1, cache_dir=tmp_path)
    stored_while_running = []
    real_store = DiskCaches.store

    def store(disk, cache):
        stored_while_running.append(any(cache is running for running in worker._busy.values()))
        real_store(disk, cache)

    monkeypatch.setattr(DiskCaches, "store", store)
    specs = [{"prompt": PROMPTS[1], "max_tokens": 30}, {"prompt": PROMPTS[2], "max_tokens": 3}]
    results = run_jobs(worker, specs)
    for spec, (tokens, done) in zip(specs, results):
        assert isinstance(done, Done) and done.batch_size == 2
        assert tokens == reference(pair, spec["prompt"], spec["max_tokens"])
    assert stored_while_running and not any(stored_while_running)
    long_tokens = results[0][0]
    # the long conversation, as it ended (the last token is never fed back), stayed cached
    assert [c.target.ids for c in worker.caches.caches] == [PROMPTS[1] + long_tokens[:-1]]


@pytest.mark.parametrize("how", ["cancelled", "shutting down"])
def test_a_job_stops_prefilling_between_chunks_once_cancelled(pair, monkeypatch, how):
    """A batch prefills a prompt 128 tokens a step: a job cancelled (or a server shutting
    down) after its first chunk prefills no more of its 5, so the others stop waiting on it."""
    long = [2] + [(7 * i) % 250 + 6 for i in range(640)]
    worker = make_worker(pair, parallel=2)
    chunks, forward = [], SequenceCache._call

    def counting(cache, tokens, *args, **kwargs):
        if tokens.shape[-1] == Engine.batch_prefill_chunk and cache.model is pair[0]:
            chunks.append(tokens.shape[-1])
            if len(chunks) == 1:
                for job in [j for j in worker.running if len(j.prompt_ids) == len(long)]:
                    worker.cancel(job) if how == "cancelled" else worker.shut_down()
        return forward(cache, tokens, *args, **kwargs)

    monkeypatch.setattr(SequenceCache, "_call", counting)
    specs = [{"prompt": long, "max_tokens": 8}, {"prompt": PROMPTS[0], "max_tokens": 24}]
    results = run_jobs(worker, specs)
    assert results[0][1].finish_reason is None if how == "cancelled" else results[0][1].status == 503
    assert len(chunks) == 1


def test_outcome_counts_change_under_the_lock(pair):
    """`/health` and `/metrics` read `Worker.counts` on the request side: every change on the
    worker thread happens under the worker's lock (unlocked `+=` loses updates)."""
    worker = make_worker(pair, parallel=2)
    unlocked = []

    class Guarded(dict):
        def __setitem__(self, key, value):
            if not worker._changed._is_owned():
                unlocked.append(key)
            super().__setitem__(key, value)

    def cancel_the_third(jobs, job, event):
        if job is jobs[2]:
            job.cancelled.set()

    worker.counts = Guarded(worker.counts)
    specs = [{"prompt": PROMPTS[0], "max_tokens": 8}, {"prompt": PROMPTS[2], "max_tokens": 8, "stop": [Faulty("x")]},
             {"prompt": PROMPTS[1], "max_tokens": 200}]
    run_jobs(worker, specs, act=cancel_the_third)
    assert (worker.counts["completed"], worker.counts["failed"], worker.counts["cancelled"]) == (1, 1, 1)
    assert not unlocked


# -- issue 42, item 7: each request's draft and verify time under batching --------------------

SHARED_FORWARD_S = 0.1  # added to every target forward shared by several rows, so it dominates


def test_share_time_splits_a_forward_by_rows():
    from mlx_spec.core.passes import Pass, share_time

    passes = [Pass(), Pass(), Pass()]
    for p, rows in zip(passes, (1, 3, 4)):
        p.rows = rows
    share_time(passes, 0.8)
    assert [p.seconds for p in passes] == pytest.approx([0.1, 0.3, 0.4])


def test_each_request_is_given_its_share_of_the_shared_forwards(pair, monkeypatch):
    """Three requests decode together, every shared target forward slowed by a known time: it
    goes into their verify times, split among them (not into their draft times, each of which
    held the whole forward), so their draft and verify times add up to no more than the run's
    wall time, and their verify times to the forwards' time."""
    import time

    from mlx_spec.core.passes import ModelPass, TargetPass

    shared = []

    def slowed(cls, passes):
        if len(passes) > 1:
            shared.append(len(passes))
            time.sleep(SHARED_FORWARD_S)
        return ModelPass.run_together.__func__(cls, passes)

    monkeypatch.setattr(TargetPass, "run_together", classmethod(slowed))
    specs = [{"prompt": p, "max_tokens": n} for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
    started = time.perf_counter()
    results = run_jobs(make_worker(pair, parallel=3), specs)
    wall = time.perf_counter() - started
    stats = [done.stats for _, done in results]
    assert all(isinstance(done, Done) and done.batch_size == 3 for _, done in results) and len(shared) > 5
    slept = SHARED_FORWARD_S * len(shared)
    assert sum(s.verify_time for s in stats) >= 0.95 * slept
    assert sum(s.draft_time for s in stats) < slept  # it held each forward whole: 3 × slept
    assert sum(s.draft_time + s.verify_time for s in stats) <= wall
    for s in stats:  # each waited for the others' rows too: its round times are longer than its share
        assert s.decode_time >= s.draft_time + s.verify_time > 0
