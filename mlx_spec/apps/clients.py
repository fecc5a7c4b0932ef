"""Many clients at once, in-process (`mlx-spec bench --clients N`): N requests decoded
together in one continuous batch (`mlx_spec.core.batch.Batch`) as `serve --parallel N` decodes
them, without HTTP, timed per request.

All N start together. Aggregate tok/s = every request's tokens / wall time from the start
to the last token; a request's tok/s = its tokens / the time from its first token to its
last; TTFT = start to its first token (prefill, and the other requests' rounds meanwhile).
Each setting (drafting off, each γ) runs once cold, then `runs` times, interleaved across
settings; medians of the warm runs. At temperature 0 every request's tokens must equal
its drafting-off tokens (the batch never changes an answer).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable, Optional, Sequence

from mlx_spec.apps.runner import AUTO, Gamma, build_engine, gamma_policy
from mlx_spec.apps.sweep import BASELINE, setting_label, token_md5
from mlx_spec.core.batch import Batch
from mlx_spec.core.policy import BatchShare, FixedGamma
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.errors import MlxSpecError


@dataclass
class Request:
    """One client's request in one run."""

    tokens: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    ttft: float = 0.0  # seconds from the start to its first token
    seconds: float = 0.0  # from the start to its last token
    first: int = 0  # tokens its first round committed (at ttft)

    @property
    def tps(self) -> float:
        """Tokens after its first round, over the time after it."""
        decoding = self.seconds - self.ttft
        return (len(self.tokens) - self.first) / decoding if decoding > 0 else 0.0


@dataclass
class ClientsRun:
    """One run of every client together."""

    setting: str
    requests: list[Request]
    wall: float
    batch_sizes: list[int]  # requests in each forward

    @property
    def aggregate_tps(self) -> float:
        return sum(len(r.tokens) for r in self.requests) / self.wall


@dataclass
class ClientsSummary:
    """Medians over a setting's warm runs."""

    setting: str
    clients: int
    aggregate_tps: float
    per_request_tps: float  # the median request's, per run; median over runs
    ttft: float  # the median request's, per run; median over runs
    max_ttft: float
    acceptance_rate: Optional[float]  # pooled over every request and warm run; None: no drafts
    mean_batch: float  # requests per forward, over every warm run
    speedup: float = 1.0  # aggregate tok/s / drafting off's
    identical: Optional[bool] = None  # at temperature 0: every request's tokens equal drafting off's
    md5s: list[str] = field(default_factory=list)  # of each request's tokens, in the first warm run

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def run_clients(engine, prompts: Sequence[list[int]], gamma: Gamma, *, params: SamplingParams,
                max_tokens: int) -> ClientsRun:
    """Every prompt as one request, all decoded together in one batch from the start."""
    share = BatchShare()  # auto γ chooses for the batch's tokens per second, as `serve` does
    requests = [Request() for _ in prompts]
    batch_sizes: list[int] = []
    start = perf_counter()

    def steps(ids, request):
        twin = engine.for_request()
        policy = (gamma_policy(gamma, twin, context=len(ids), batch=share) if gamma.fixed is None
                  else FixedGamma(gamma.fixed))
        try:
            yield from twin.rounds(ids, params, gamma=policy, max_tokens=max_tokens, stats=request.stats,
                                   batched=True, alone=batch.alone)
        finally:
            share.leave(policy)

    def out(generator, item):  # a committed round of `generator`'s request
        request = requests[generators.index(generator)]
        now = perf_counter() - start
        if not request.tokens:
            request.ttft, request.first = now, len(item.tokens)
        request.seconds = now
        request.tokens += item.tokens

    batch = Batch(out)
    generators = [steps(ids, r) for ids, r in zip(prompts, requests)]
    for generator in generators:
        batch.add(generator)
    while batch:
        rows = batch.step()
        if rows:
            batch_sizes.append(len(rows))
    return ClientsRun("", requests, perf_counter() - start, batch_sizes)


def bench_clients(pair, prompts: Sequence[list[int]], *, drafter: Optional[str] = None,
                  gammas: Sequence[Gamma] = (Gamma(AUTO),), runs: int = 3, max_tokens: int = 64,
                  params: SamplingParams = SamplingParams(), engine_options: Optional[dict] = None,
                  progress: Optional[Callable[[int, int, str], None]] = None) -> list[ClientsSummary]:
    """`run_clients` for drafting off and each γ in `gammas`: one cold run each, then `runs`
    warm runs interleaved; one `ClientsSummary` per setting, drafting off first."""
    if not prompts:
        raise MlxSpecError("no prompts to benchmark")
    plain = build_engine(pair, "none", **(engine_options or {}))
    spec = build_engine(pair, drafter, **(engine_options or {}))
    if spec.drafter is not None and spec.drafter.remembers:  # runs must not draft from earlier runs' answers
        spec = spec.for_request(memory=None)
    settings: list[Gamma] = [Gamma.OFF] + [g for g in gammas if g != 0]
    total, done = len(settings) * (runs + 1), 0
    warm: dict[str, list[ClientsRun]] = {setting_label(g): [] for g in settings}
    for rep in range(runs + 1):  # rep 0: the cold pass
        for gamma in settings:
            label = setting_label(gamma)
            if progress:
                progress(done, total, f"{len(prompts)} clients {label} {'cold' if rep == 0 else f'run {rep}'}")
            run = run_clients(plain if gamma == 0 else spec, prompts, gamma, params=params, max_tokens=max_tokens)
            run.setting = label
            if rep:
                warm[label].append(run)
            done += 1
    if progress:
        progress(done, total, "done")
    summaries = [_summarize(label, r) for label, r in warm.items()]
    base = warm[BASELINE]
    for summary in summaries:
        summary.speedup = summary.aggregate_tps / summaries[0].aggregate_tps
        if params.greedy:
            summary.identical = all(token_md5(a.tokens) == token_md5(b.tokens)
                                    for run in warm[summary.setting] for a, b in zip(run.requests, base[0].requests))
    return summaries


def _summarize(label: str, runs: list[ClientsRun]) -> ClientsSummary:
    median = statistics.median
    requests = [r for run in runs for r in run.requests]
    drafted = sum(r.stats.drafted for r in requests)
    sizes = [s for run in runs for s in run.batch_sizes]
    return ClientsSummary(
        label, len(runs[0].requests),
        aggregate_tps=median(run.aggregate_tps for run in runs),
        per_request_tps=median(median(r.tps for r in run.requests) for run in runs),
        ttft=median(median(r.ttft for r in run.requests) for run in runs),
        max_ttft=max(r.ttft for r in requests),
        acceptance_rate=sum(r.stats.accepted for r in requests) / drafted if drafted else None,
        mean_batch=sum(sizes) / len(sizes) if sizes else 0.0,
        md5s=[token_md5(r.tokens) for r in runs[0].requests],
    )
