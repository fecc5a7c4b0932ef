"""A worker thread owns the device, both models' caches and the detokenizer; requests wait
in a bounded queue in front of it.

Up to `parallel` jobs decode together (`mlx_spec.core.batch`): each job is a generator that
yields its round's target pass; every round the worker admits waiting jobs while there is
room, then runs the running jobs' passes in one forward. A job that ends (finished,
failed, cancelled) leaves between rounds. A job alone in the batch runs its rounds as a
serial job does (`Engine.rounds(alone=...)`). With parallel 1 a job yields nothing and runs
to its end, as one generation at a time always did.

All MLX work runs on this one thread (mlx-lm's server does the same), and no two running
requests ever share a cache. The caches live as long as the server, several conversations' worth
(`caches.CachePool`): each request prefills only the tokens after the longest common prefix
of its prompt and what a cache holds, so a conversation that grows by a turn reuses
everything before it, however many others came in between, and a request that diverges
earlier starts from where it diverges.

A chat answer's thought is split from its text here (`Piece.reasoning`), and the rounds that
began inside it are counted apart (`Done.phases`; `answer.Answer`). A thought budget ends
the first run at that many tokens if the thought is still open then: its end marker is
forced, and a second run continues from the committed tokens (the caches hold them, so
nothing is prefilled again) on the same random stream, text and stop strings. A thought
closed by then splits nothing.

A request is cancelled by setting `Job.cancelled` (its client went away). A waiting job
gives up its place in the queue at once; a running one is checked between rounds (and
between its prompt's prefill chunks in a batch), and the worker closes the
`stream_request` generator, which leaves both caches holding exactly
the tokens committed so far, ready for the next request. `shut_down` (on SIGTERM/SIGINT)
ends the running jobs the same way with a 503 event and answers every waiting one 503.

Keep-alive (`serve --keep-alive`, a request's `keep_alive`): once nothing has run or waited
for that long, the worker drops the engine (both models) and its prompt caches and frees
MLX's memory; the next job loads them again first with the CLI's own loader (`load`), and
its `Done` says so. The tokenizer stays loaded (it is small, and the request side needs it
to tokenize before a job reaches the worker). Reloaded weights are the same, so answers are.
"""

from __future__ import annotations

import gc
import logging
import math
import re
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from mlx_spec.apps.runner import Gamma, gamma_policy
from mlx_spec.apps.stream import Response, stream_request
from mlx_spec.core.batch import PREFILLING, Batch
from mlx_spec.core.cache.files import cache_key
from mlx_spec.core.engine import Request, in_company
from mlx_spec.core.policy import BatchShare
from mlx_spec.core.sampling import KeyStream
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.token_memory import Memories
from mlx_spec.errors import MlxSpecError
from mlx_spec.server.answer import Answer
from mlx_spec.server.cache_pool import CachePool, default_budget
from mlx_spec.server.disk_caches import DiskCaches
from mlx_spec.server.memory_files import MemoryFiles
from mlx_spec.server.jobs import SHUTTING_DOWN, Busy, Done, Failed, Job, Piece, ShuttingDown, cached_count
from mlx_spec.server.metrics import Metrics
from mlx_spec.server.prompt_scores import prompt_logprobs

log = logging.getLogger("mlx_spec.server")
RECENT_JOBS = 32  # jobs whose device time Retry-After estimates from
MAX_RETRY_AFTER_S = 60
FOREVER = math.inf  # a keep-alive that never unloads
STUCK_S = 300.0  # a running job with no progress this long: `/health` calls the worker stuck
ERROR_PAUSE_S = 0.1  # after an error the worker loop survived, so a lasting one cannot spin it
MEMORY_SCOPES = ("server", "key", "off")  # `Worker`'s draft_memory
MEMORY_SAVE_S = 60.0  # with a cache folder, changed draft memories are written at most this often
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value) -> float:
    """Ollama's keep-alive as seconds: a number of seconds, or a Go duration such as "5m",
    "30s", "1h30m", "500ms"; a negative one (or "forever") is `FOREVER`, 0 unloads at once,
    and so is one longer than a thread can wait (`threading.TIMEOUT_MAX`, about 292 years):
    an idle wait of 1e10 s would raise OverflowError in the worker thread.
    Raises ValueError with a one-line message."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if text == "forever":
            return FOREVER
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{value!r} is not a duration (e.g. 5m, 30s, 1h, 300, -1 or "
                                 "forever)") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        raise ValueError(f"{value!r} is not a duration")
    if math.isnan(seconds):
        raise ValueError(f"{value!r} is not a duration")
    return FOREVER if seconds < 0 or seconds >= threading.TIMEOUT_MAX else seconds


@dataclass
class Run:
    """How one `stream_request` run of a job (`Worker._stream`) ended."""

    finish: Optional[str] = None  # "stop", "length", or None when cancelled or paused
    stop_string: Optional[str] = None  # the stop string that ended it, if one did
    committed: list[int] = field(default_factory=list)  # the ids its rounds committed
    prefilled: int = 0  # prompt tokens the target's prefill processed (a job's first run only)
    paused: bool = False  # ended at the thought budget, the thought still open


UNLOAD = object()  # `Worker._next_job`: the keep-alive ran out


class Worker:
    """The generation thread and its bounded queue.

    Args:
        engine: the `Engine`; its `make_prompt_cache` makes each cached conversation's caches.
        tokenizer: mlx-lm's `TokenizerWrapper` (only this thread uses its detokenizer).
        gamma: a `Gamma` (or its text, parsed once here); "auto" builds a fresh `AutoGamma` per
            request from the cached cost curve, exactly as `mlx-spec generate` does, and a
            seeded one learns nothing from the clock, so a seeded request draws the same
            tokens as the same command would, however busy the machine.
        queue_size: requests that may wait while one generates; more get `Busy`.
        cache_budget: bytes of KV the cached conversations may hold; None: half of the
            device memory left once the models are loaded.
        load: makes the engine again after an unload (the CLI's loader); None: never unload.
        keep_alive: idle seconds before unloading when a job names none (`FOREVER`: never).
        cache_dir: a folder where evicted conversations' caches go, and where they are found
            again, by this server or a later one (`disk_caches.DiskCaches`); None: memory only.
        cache_disk: bytes the folder's cache files may take.
        parallel: jobs decoded together (`mlx_spec.core.batch`): each round one target forward
            verifies every running job's block; jobs join and leave between rounds. 1: one
            job at a time, as `Engine.rounds` decodes alone.
        draft_memory: for a drafter that `remembers` (the suffix drafter), whose earlier
            requests a job drafts from: "server" (every job's), "key" (its API key's:
            `Job.tenant`), "off" (none). The memories live as long as the worker, across
            keep-alive unloads; draft_memory_tokens bounds each. With a `cache_dir` each
            scope's memory is read from its file there when first used, and written back
            (`memory_files`) when the server stops or unloads, and at most every
            `MEMORY_SAVE_S` after a request.
    """

    def __init__(self, engine, tokenizer, gamma: Gamma | str = "auto", queue_size: int = 8,
                 cache_budget: Optional[int] = None, load: Optional[Callable] = None,
                 keep_alive: float = FOREVER, cache_dir=None, cache_disk: int = 10 * 2**30,
                 parallel: int = 1, draft_memory: str = "server", draft_memory_tokens: int = 1 << 20):
        self.engine = engine
        self.load = load
        self.keep_alive = keep_alive_seconds(keep_alive) if load is not None else FOREVER
        self._idle_for = self.keep_alive  # the last job's keep-alive, or the server's
        self._idle_since = time.monotonic()
        self.tokenizer = tokenizer
        if queue_size < 1:  # queue.Queue(0) would be unbounded
            raise ValueError("queue_size must be at least 1")
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        self.parallel = parallel
        if draft_memory not in MEMORY_SCOPES:
            raise ValueError(f"draft_memory must be one of {', '.join(MEMORY_SCOPES)}")
        self.draft_memory = draft_memory
        self.memories = Memories(0 if draft_memory == "off" else draft_memory_tokens)
        self._memories_saved = time.monotonic()
        self.gamma = Gamma.parse(gamma) if engine.drafter is not None else Gamma.OFF
        self.caches = CachePool(engine.make_prompt_cache,
                                default_budget() if cache_budget is None else cache_budget)
        self.cache_dir, self.cache_disk = cache_dir, cache_disk
        self.disk = None  # set on the worker thread, which owns every MLX array
        self.metrics = Metrics()
        self.queue_size = queue_size
        self._waiting: deque[Job] = deque()  # guarded by _changed
        self._changed = threading.Condition()
        self.running: dict[Job, float] = {}  # job -> when it took the device; guarded by _changed
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0}  # guarded by _changed
        self._durations: deque[float] = deque(maxlen=RECENT_JOBS)  # guarded by _changed
        self._thread = threading.Thread(target=self._run, name="mlx-spec-generate", daemon=True)
        self._stopping = False
        self._busy: dict[Job, object] = {}  # running jobs' prompt caches (worker thread only)
        self._share = BatchShare()  # the running jobs' γ choices, for auto γ in a batch
        self._alone = None  # the running batch's `Batch.alone` (worker thread only)
        self._beat = time.monotonic()  # the worker's last sign of progress (`health`)
        self.stuck_after = STUCK_S
        self.errors = 0  # exceptions the worker loop survived

    # -- the request side (event-loop thread) ---------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._changed:
            self._check_room()
            self._waiting.append(job)
            self._changed.notify()

    def check_room(self, coming: int = 0) -> None:
        """Raise now what `submit` would raise for a full queue or a stopping server, with
        `coming` more jobs in it (being prepared), so a request is refused before its costly
        preparation (tokenizing); `submit` checks again."""
        with self._changed:
            self._check_room(coming)

    def _check_room(self, coming: int = 0) -> None:  # with _changed held
        if self._stopping:
            raise ShuttingDown()
        self._drop_cancelled()
        if len(self._waiting) + coming >= self.queue_size:
            self.counts["refused"] += 1
            raise Busy(self._retry_after(ahead=len(self._waiting) + coming))

    def _retry_after(self, ahead: int) -> int:  # with _changed held
        """Seconds until the running job and `ahead` more are likely done: each takes the
        median of recent jobs' device time (while none has finished, the running one's time so
        far), rounded up, within [1, MAX_RETRY_AFTER_S]. A median, as failed and cancelled
        jobs in the mix, over in moments, would drag a mean far below an answer's time."""
        if self._durations:
            typical = statistics.median(self._durations)
        else:
            typical = time.perf_counter() - min(self.running.values()) if self.running else 1.0
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(typical * (ahead + 1))))

    def cancel(self, job: Job) -> None:
        """Stop `job`: a waiting one leaves the queue now, a running one after this round."""
        job.cancelled.set()
        with self._changed:
            self._drop_cancelled()

    def shut_down(self) -> None:
        """Take no more jobs, end the running ones between rounds with a 503 event and answer
        each waiting one 503; returns at once (the thread ends on its own)."""
        with self._changed:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            running = list(self.running)
            self._changed.notify()
        for job in running:
            job.cancelled.set()
        for job in waiting:
            job.cancelled.set()
            job.emit(SHUTTING_DOWN)

    def stop(self, timeout: float = 10.0) -> None:
        """`shut_down`, then wait for the thread to end (longer when it writes the cached
        conversations to disk)."""
        self.shut_down()
        self._thread.join(timeout if self.cache_dir is None else max(timeout, 120.0))

    def problem(self) -> Optional[str]:
        """Why the worker cannot serve (its thread has ended, or a running job has made no
        progress for `stuck_after` seconds), in words; None when it can."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            return "the generation thread has ended"
        with self._changed:
            running = bool(self.running)
        silent = time.monotonic() - self._beat
        if running and silent > self.stuck_after:
            return f"the generation thread has made no progress for {silent:.0f} s"
        return None

    def health(self) -> dict:
        with self._changed:
            self._drop_cancelled()
            queued, running, counts = len(self._waiting), len(self.running), dict(self.counts)
        return {"loaded": self.engine is not None, "busy": running > 0, "running": running,
                "parallel": self.parallel, "queued": queued, "queue_size": self.queue_size, **counts,
                "prompt_caches": len(self.caches.caches), "prompt_cache_bytes": self.caches.nbytes,
                "prompt_cache_budget": self.caches.budget,
                "prompt_cache_disk_hits": self.disk.hits if self.disk is not None else 0,
                "worker_errors": self.errors}

    def _drop_cancelled(self) -> None:  # with _changed held
        kept = deque(job for job in self._waiting if not job.cancelled.is_set())
        self.counts["cancelled"] += len(self._waiting) - len(kept)
        self._waiting = kept

    # -- the device side (worker thread) -------------------------------------------------

    def _run(self) -> None:
        """The worker loop. It survives any exception: the jobs it was running fail (in their
        API's error shape), one line is logged, and it goes on with the next."""
        self._open_disk()
        # With parallel 1 a job's steps never yield a pass: `step` runs it to its end.
        batch, jobs = Batch(), {}  # jobs: each running job's steps -> the job
        self._alone = batch.alone  # a job's round asks it whether it decodes alone
        while True:
            try:
                if not self._step(batch, jobs):
                    break
            except Exception as error:  # noqa: BLE001 - nothing may end this thread silently
                self.errors += 1
                log.error("the generation worker survived %s: %s", type(error).__name__, _first_line(error))
                log.debug("the worker's error", exc_info=True)
                self._fail_all(jobs, error)
                batch, jobs = Batch(), {}
                self._alone = batch.alone
                time.sleep(ERROR_PAUSE_S)
        self.caches.persist()
        self._save_memories()

    def _step(self, batch: Batch, jobs: dict) -> bool:
        """Admit waiting jobs while there is room, then run one step of the batch; False once
        the server stops (`_next_job` waits while there is nothing to do)."""
        self._beat = time.monotonic()
        while len(batch) < self.parallel:
            job = self._next_job(wait=not batch)
            self._beat = time.monotonic()
            if job is None:
                break
            if job is UNLOAD:
                self._unload()
                continue
            steps = self._serve(job, batched=self.parallel > 1)
            batch.add(steps)
            jobs[steps] = job
        if not batch:
            return False
        rows = batch.step()
        if rows:
            self.metrics.observe_batch(len(rows))
        for steps in rows:
            jobs[steps].batch_size = max(jobs[steps].batch_size, len(rows))
        for steps in [s for s in jobs if s not in batch.active]:
            del jobs[steps]
        return True

    def _fail_all(self, jobs: dict, error: Exception) -> None:
        """After an error outside any one job (a shared forward, the pool): each job still
        running fails with a 500, its cache is dropped (whatever state the error left), and
        it leaves."""
        for steps, job in jobs.items():
            job.emit(Failed(500, f"internal error during generation ({type(error).__name__})"))
            job.cancelled.set()
            self._count("failed")
            cache = self._busy.get(job)
            if cache is not None:
                self.caches.discard(cache)
            try:
                steps.close()  # its `finally` releases the job (`_serve`)
            except Exception:  # noqa: BLE001 - a generator that fails while closing is gone anyway
                log.debug("closing a failed job", exc_info=True)
            with self._changed:
                if job in self.running:  # `_serve`'s finally did not get to it
                    self._durations.append(time.perf_counter() - self.running.pop(job))
        self._busy.clear()

    def _open_disk(self) -> None:
        if self.cache_dir is None:
            return
        if self.memories.tokens:
            self.memories.files = MemoryFiles.for_model(self.cache_dir, self.engine.target, self.tokenizer)
        try:
            self.disk = DiskCaches(self.cache_dir, self.cache_disk, cache_key(self.engine, self.tokenizer))
        except OSError as error:
            log.warning("prompt cache folder %s unusable (%s): caching in memory only",
                        self.cache_dir, error.strerror or error)
            return
        self.caches = CachePool(self.caches.make, self.caches.budget, self.disk, self.engine)

    def _next_job(self, wait: bool = True):
        """The next job to run, `UNLOAD` once the keep-alive has run out with nothing to
        do, or None when the server stops (or, unless `wait`, when none is waiting)."""
        with self._changed:
            while True:
                while not self._waiting and not self._stopping:
                    if not wait:
                        return None
                    left = self._idle_since + self._idle_for - time.monotonic()
                    if self.engine is not None and left <= 0:
                        return UNLOAD
                    # capped: a wait longer than TIMEOUT_MAX raises OverflowError
                    self._changed.wait(None if math.isinf(left) or self.engine is None
                                       else min(left, threading.TIMEOUT_MAX))
                if self._stopping:
                    return None
                self._drop_cancelled()  # clients that left while they waited
                if self._waiting:
                    job = self._waiting.popleft()
                    self.running[job] = time.perf_counter()
                    return job

    def _serve(self, job: Job, batched: bool = False):
        """A generator: the job from start to finish, yielding its target passes when
        `batched` (for `_run`'s batch to run beside others'), else none. An error ends this
        job alone."""
        # The cache lives in this frame only: it holds the target model, which an unload
        # must find unreferenced once the job is done.
        try:
            load_seconds = self._ensure_loaded()
            # another running job's cache is mid-round: never shared, never forked
            cache = self.caches.take(job.prompt_ids if job.images is None else job.images.keys,
                                     busy=self._busy.values())
        except Exception as error:  # the models did not load: this job fails, the next tries again
            log.exception("loading the models failed")
            self._count("failed")
            job.emit(Failed(500, f"internal error loading the model ({type(error).__name__})"))
            self._finish(job)
            return
        self._busy[job] = cache
        try:
            engine = self._engine_for(job, batched)
            yield from self._generate(job, engine, cache, load_seconds, batched)
        except MlxSpecError as error:
            self._count("failed")
            job.emit(Failed(400, str(error)))
        except Exception as error:  # keep serving; the log has the traceback
            log.exception("generation failed")
            self._count("failed")
            self.caches.discard(cache)  # whatever state the error left, start clean
            job.emit(Failed(500, f"internal error during generation ({type(error).__name__})"))
        finally:
            self._busy.pop(job, None)
            self.caches.fit(busy=self._busy.values(), used=cache)  # disk errors are its warnings
            self._finish(job)

    def _engine_for(self, job: Job, batched: bool):
        """The engine a job decodes with: its drafter drafts from the job's memory (where it
        remembers), and is its own in a batch."""
        drafter = self.engine.drafter
        if drafter is not None and drafter.remembers:
            return self.engine.for_request(self.memories.get(job.tenant if self.draft_memory == "key" else None))
        return self.engine.for_request() if batched else self.engine

    def _count(self, outcome: str) -> None:
        """One more job ended so (the request side reads the counts: under the lock)."""
        with self._changed:
            self.counts[outcome] += 1

    def _finish(self, job: Job) -> None:
        with self._changed:
            self._durations.append(time.perf_counter() - self.running.pop(job, time.perf_counter()))
            self._idle_for = self.keep_alive if job.keep_alive is None or self.load is None else job.keep_alive
            self._idle_since = time.monotonic()
        if time.monotonic() - self._memories_saved >= MEMORY_SAVE_S:
            self._save_memories()

    def _save_memories(self) -> None:
        """Write the draft memories that changed to their files (with a cache folder). A
        memory file is an optimisation: whatever goes wrong is a warning, never a failed
        request or an ended worker."""
        self._memories_saved = time.monotonic()
        try:
            self.memories.persist()
        except Exception as error:  # noqa: BLE001 - see above
            log.warning("could not write the draft memories (%s: %s)", type(error).__name__, _first_line(error))

    def _unload(self) -> None:
        """Drop both models and every prompt cache, and give their memory back."""
        self.caches.persist()
        self._save_memories()
        self.engine = None
        self.caches = CachePool(None, self.caches.budget, self.disk)
        gc.collect()
        mx.clear_cache()
        log.info("models unloaded after %.0f s idle", self._idle_for)

    def _ensure_loaded(self) -> Optional[float]:
        """Load the models if they were unloaded; the seconds that took, else None."""
        if self.engine is not None:
            return None
        began = time.perf_counter()
        engine = self.load()
        self.caches = CachePool(engine.make_prompt_cache, self.caches.budget, self.disk, engine)
        self.engine = engine
        return time.perf_counter() - began

    def _generate(self, job: Job, engine, cache, load_seconds: Optional[float], batched: bool):
        stats = Stats()
        if job.score_prompt:  # a forward of its own, before the answer's (`prompt_scores`)
            job.emit(Piece("", prompt_logprobs=prompt_logprobs(
                engine.target, job.prompt_ids, job.logprobs or 0, engine.prefill_chunk)))
        if job.max_tokens == 0:  # echo only: the prompt is the whole answer
            self._count("completed")
            job.cached_tokens = 0
            job.emit(Done("length", 0, 0, stats.snapshot(), load_seconds=load_seconds))
            return
        policy = gamma_policy(self.gamma, engine, context=len(job.prompt_ids),
                              reproducible=job.params.seed is not None, batch=self._share if batched else None)
        try:
            answer = Answer(job, self.tokenizer, engine.eos_ids)
            keys = KeyStream(job.params.seed)  # one random stream for every run of the answer
            prompt, room, forced = job.prompt_ids, job.max_tokens, 0
            matcher = job.grammar.matcher(engine.eos_ids) if job.grammar is not None else None
            pause = None  # where the thought budget may end the first run
            if job.thought_budget is not None and job.think is not None and job.thought_budget < room:
                pause = job.thought_budget
            first, prefilled = True, 0  # prefilled: prompt tokens the target's prefill processed
            while True:
                request = job_request(job, prompt, room, policy, matcher, keys, pause)
                run = yield from self._stream(job, engine, cache, request, stats, answer, batched, first)
                if first:
                    first, prefilled = False, run.prefilled
                finish, stop_string = run.finish, run.stop_string
                if not run.paused:
                    break
                # The thought budget is spent with the thought still open: its end marker is
                # forced. What follows is the target's distribution given that forced text (the
                # thought's end itself is not sampled), from the committed tokens the caches
                # keep, on the same random stream, text and stop strings.
                prompt, room = prompt + run.committed, room - len(run.committed)
                marker = list(self.tokenizer.encode(job.think.end, add_special_tokens=False))[:room]
                prompt, room, forced = prompt + marker, room - len(marker), forced + len(marker)
                piece, stop_string = answer.force(marker, stats)
                if piece is not None:
                    job.emit(piece)
                if stop_string is None and room <= 0:
                    piece, stop_string = answer.end(stats)
                    if piece is not None:
                        job.emit(piece)
                if stop_string is not None or room <= 0:
                    finish = "stop" if stop_string is not None else "length"
                    break
                pause = None
            tokens = answer.released + forced
            self._count("completed" if finish else "cancelled")
            job.cached_tokens = cached_count(job, prefilled)
            self.metrics.observe(stats, job.cached_tokens)
            if finish is None and self._stopping:
                job.emit(SHUTTING_DOWN)
                return
            piece = answer.close()
            if piece is not None:
                job.emit(piece)
            job.emit(Done(finish, tokens, prefilled, stats.snapshot(), stop_string, answer.phases, load_seconds,
                          job.batch_size))
        finally:
            self._share.leave(policy)  # its row is gone from the batch

    def _stream(self, job: Job, engine, cache, request: Request, stats: Stats, answer: Answer, batched: bool,
                first: bool):
        """One run of `request` (`stream_request`), its text split and emitted; the job's
        `first` (its prompt's) counts what the target prefilled, a later one continues the
        job's own tokens. At the request's `pause_at` (a thought budget) the run ends there
        if the thought is still open, and goes on otherwise. A generator of its target
        passes (`batched`); returns its `Run`."""
        run = Run()

        def on_prefill(done: int, total: int) -> None:  # called by the target's prefill only
            run.prefilled = total
            self._beat = time.monotonic()

        responses = stream_request(engine, self.tokenizer, request, prompt_cache=cache, stats=stats,
                                   prefill_progress=on_prefill if first else None,
                                   company=in_company(job.params, batched, self._alone if batched else None),
                                   text=answer.text)
        try:
            for response in responses:
                self._beat = time.monotonic()
                if response is PREFILLING and job.cancelled.is_set():
                    break  # between prompt chunks: the cache holds the chunks done, the others go on
                if not isinstance(response, Response):  # for the batch (`_run`)
                    yield response
                    continue
                run.committed += response.round.tokens
                run.finish, run.stop_string = response.finish_reason, response.stop_string
                piece = answer.round(response)
                if first:
                    job.cached_tokens = cached_count(job, run.prefilled)  # the prefill is done
                if piece is not None:
                    job.emit(piece)
                if run.finish is not None:
                    break
                if job.cancelled.is_set():
                    break
                if request.pause_at is None:
                    continue
                if answer.thought_closed:
                    request.pause_at = None  # the thought is over: the run goes on, unsplit
                elif len(run.committed) >= request.pause_at:
                    if answer.splitter.thinking:
                        run.paused = True
                        break
                    request.pause_at = None  # no thought open at the budget: no split either
        finally:
            responses.close()  # between rounds: the caches hold exactly what was committed
        return run


def job_request(job: Job, prompt: list[int], max_tokens: int, policy, constraint, keys: KeyStream,
                pause_at: Optional[int] = None) -> Request:
    """The engine's `Request` for one run of `job` from `prompt`: the job's own prompt, or
    that continued by its own tokens (past a thought budget), whose images keep their places."""
    images = job.images if job.images is None or prompt is job.prompt_ids else job.images.extended(prompt)
    return Request(prompt, job.params, policy, max_tokens, job.logprobs, images, constraint, keys, pause_at)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
