"""The generation worker in-process for the server tests (tests/server, tests/core): the
tiny Gemma 3 pair as mlx-lm loads it, a `Worker` over it, and its jobs submitted as the
HTTP routes submit them."""

import asyncio

import pytest
from mlx_lm import load

from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.drafters import ModelDrafter
from mlx_spec.server.worker import Done, Failed, Job, Worker
from mlx_spec.testing.tiny import TINY_VOCAB


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    target, tokenizer = load(tiny_dirs[0])
    draft, _ = load(tiny_dirs[1])
    return target, draft, tokenizer


def make_worker(pair, parallel: int, context_length=None, gamma="2", **options) -> Worker:
    target, draft, tokenizer = pair
    engine = Engine(target, ModelDrafter(draft, TINY_VOCAB), eos_ids=tokenizer.eos_token_ids,
                    context_length=context_length)
    return Worker(engine, tokenizer, gamma=gamma, parallel=parallel, **{"cache_budget": 2**28, **options})


def run_jobs(worker: Worker, specs: list[dict], act=None) -> list[tuple[list[int], object]]:
    """Submit one job per spec (prompt, max_tokens, and Job fields) before the worker starts
    (so they join together), collect each job's token ids and its last event. `act(jobs,
    job, event)` is called on each event (from the event loop)."""
    loop = asyncio.new_event_loop()
    thought = ("think", "thinking", "thought_budget")  # the thought's markers, state and budget
    jobs = [Job(spec["prompt"], spec.get("params", SamplingParams()), spec["max_tokens"], spec.get("stop", ()),
                loop, logprobs=0, grammar=spec.get("grammar"), **{k: spec[k] for k in thought if k in spec})
            for spec in specs]

    async def collect(job):
        tokens = []
        while True:
            event = await asyncio.wait_for(job.events.get(), 120)
            if act is not None:
                act(jobs, job, event)
            if isinstance(event, (Done, Failed)):
                return tokens, event
            tokens += [t for t, _, _ in event.logprobs]

    async def collect_all():
        return await asyncio.gather(*map(collect, jobs))

    for job in jobs:
        worker.submit(job)
    worker.start()
    try:
        return loop.run_until_complete(collect_all())
    finally:
        worker.stop()
        loop.close()
