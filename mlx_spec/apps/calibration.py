"""Measured cost curves: what a target forward costs at widths 1..γmax+1, and a draft step.

Speculation pays only when verifying γ+1 positions costs little more than one step, and
that depends on chip, quantization and MLX version (an Apple GPU's 4-bit matmul costs ~6x
at 8 rows; this CPU's fp32 matmul grows linearly). So it is measured, not assumed, at the
current context length, and cached on disk per (models, MLX version, device).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec.apps.distributed import world as this_world
from mlx_spec.cache.sequence import SequenceCache
from mlx_spec.core.cost_model import CostCurve, non_decreasing
from mlx_spec.drafters.mtp import MtpDrafter
from mlx_spec.models import gemma4_assistant
from mlx_spec.runtime import blas

STALE_AFTER_DAYS = 30
HOPELESS = 0.85  # t(w) >= 0.85·w·t(1): a w-row verify costs nearly w single steps
BUDGET_S = 1.0  # keep timing fast models for about this long (medians of many passes)
MAX_PASSES = 50
BATCH_WIDTH = 64  # the most rows a batch's forward is priced at from measurement (`serve --parallel`)
WIDE_FIRST = 16  # the batch widths measured: this and BATCH_WIDTH (linear between them)


def fingerprint(model) -> str:
    """A short identity for a model: class, shapes and dtypes of its parameters."""
    shapes = [(k, tuple(v.shape), str(v.dtype)) for k, v in tree_flatten(model.parameters())]
    digest = hashlib.sha256(repr((type(model).__module__, shapes)).encode()).hexdigest()
    return digest[:16]


def _median_times(
    runs: list[Callable[[], None]], repeats: int, budget_s: float, samples: Optional[list[list[float]]] = None,
    agree: Callable[[bool], bool] = bool,
) -> list[float]:
    """Median seconds of each function, timed round-robin (so drift hits all alike) until
    each has `repeats` samples, and for more passes while `budget_s` lasts (fast models are
    measured many times, slow ones `repeats` times). `samples`: timings already taken of
    warmed-up functions, which count toward `repeats`; without them each is first run
    once untimed (the first call compiles kernels and allocates). `agree`: turns this
    process's decision to stop into rank 0's, so ranks of a sharded model (whose forwards
    are collective) run the same number of passes."""
    if samples is None:
        for run in runs:
            run()
        samples = [[] for _ in runs]
    start = time.perf_counter()
    while len(samples[0]) < MAX_PASSES:
        if agree(len(samples[0]) >= repeats and time.perf_counter() - start > budget_s):
            break
        for run, times in zip(runs, samples):
            begin = time.perf_counter()
            run()
            times.append(time.perf_counter() - begin)
    return [statistics.median(times) for times in samples]


def _fill_context(seq: SequenceCache, context: int) -> None:
    """Make `seq` hold `context` positions. A forward's cost depends on how many keys it
    attends to, not on their values, so after one real token the KV layers are padded with
    zeros: a real prefill would cost more than the measurement (21 s for 256 tokens of
    the 270M in float32 on a 2-core CPU)."""
    filler = [(31 * i) % 1000 + 10 for i in range(context)]
    if not seq.rollbackable:  # not all plain/windowed KV: recurrent state must be computed
        seq.prefill(filler)
        return
    seq.prefill(filler[:1])
    for layer in seq.cache:
        keys, values = layer.keys, layer.values  # [B, heads, capacity, head_dim]
        B, heads = keys.shape[:2]
        layer.update_and_fetch(
            mx.zeros((B, heads, context - 1, keys.shape[3]), keys.dtype),
            mx.zeros((B, heads, context - 1, values.shape[3]), values.dtype),
        )
    mx.eval([(layer.keys, layer.values) for layer in seq.cache])
    seq.ids = filler


def _forward_timer(seq: SequenceCache, width: int) -> Callable[[], None]:
    tokens = mx.array([(17 * i) % 1000 + 10 for i in range(width)], mx.uint32)

    def run():
        with blas.threads_for(width):  # as a batch's forward of this width runs
            mx.eval(seq.forward(tokens))
        seq.settle([])  # leave the context as it was

    return run


def _assistant_timer(assistant, target, target_seq: SequenceCache) -> Callable[[], None]:
    """One MTP draft step as the drafter takes it: the target's K/V gathered from
    `target_seq`, the embedding, the assistant's layers and head."""
    drafter = MtpDrafter(assistant, target)
    drafter.state = target_seq
    drafter.h = mx.zeros_like(drafter.embed(mx.array([[10]])))  # any h costs the same
    history = [10]

    def run():
        mx.eval(drafter.propose(1, history).tokens)

    return run


def measure_costs(
    target,
    draft=None,
    *,
    max_width: int = 7,
    context: int = 256,
    repeats: int = 3,
    progress: Optional[Callable[[int, int], None]] = None,
    early_stop: bool = True,
    world=None,
) -> CostCurve:
    """Time target forwards at widths 1..max_width and one draft step, at `context` tokens.

    Args:
        target, draft: mlx-lm models (draft None: a model-free drafter, step cost 0), or a
            Gemma 4 MTP assistant as the draft (its step is timed over the target's cache).
        progress: called with (done, total) measurements.
        early_stop: stop widening once a verify costs about as many single steps as it
            has rows (nothing wider can pay); benchmarks pass False for the whole curve.
        world: a `distributed.World` whose ranks shard `target`: every rank runs the same
            forwards (communication included in the times), rank 0 times the draft and
            decides, and every rank returns rank 0's curve. Default: this process's world.
    """

    w = world or this_world()
    if w.active and not w.is_root:
        draft = None  # the draft runs alone: only rank 0's timing of it is used
    total = max_width + (draft is not None)
    target_seq = SequenceCache(target, slack=max_width + 1)
    _fill_context(target_seq, context)
    # A first look, width by width, finds how wide is worth measuring; its timings are
    # the first samples of the round-robin that follows.
    timers, first = [], []
    for width in range(1, max_width + 1):
        timers.append(_forward_timer(target_seq, width))
        first.append(_median_times(timers[-1:], 1, 0.0, agree=w.agree)[0])
        if progress:
            progress(width, total)
        if w.agree(early_stop and width >= 2 and first[-1] >= HOPELESS * width * first[0]):
            # Cost already grows with every row (compute-bound): wider verifies can only
            # lose, so stop measuring and let verify_time() extend the slope.
            break
    verify = _median_times(timers, repeats, BUDGET_S, samples=[[t] for t in first], agree=w.agree)
    verify = non_decreasing(verify)
    draft_step = draft_step2 = 0.0
    if isinstance(draft, gemma4_assistant.Model):
        # An MTP assistant's step reads the target's cache, so it is timed over the target's
        # filled context; it has no cache to catch up after a fully accepted round.
        draft_step = _median_times([_assistant_timer(draft, target, target_seq)], repeats, BUDGET_S / 2)[0]
        draft_step2 = draft_step
        if progress:
            progress(total, total)
    elif draft is not None:
        draft_seq = SequenceCache(draft, slack=3)
        _fill_context(draft_seq, context)
        draft_step, draft_step2 = _median_times(
            [_forward_timer(draft_seq, 1), _forward_timer(draft_seq, 2)], repeats, BUDGET_S / 2
        )
        if progress:
            progress(total, total)
    curve = CostCurve(verify, draft_step, context, draft_step2)
    return CostCurve(**w.broadcast_json(asdict(curve))) if w.active else curve


def measure_batch_widths(target, base: CostCurve, *, max_width: int, batch_width: int, world=None) -> list:
    """[[rows, seconds]] of target forwards at WIDE_FIRST and `batch_width` rows (a batch's
    verify: several requests' blocks cost about what one request's rows do), at `base`'s
    context, above `base`'s widest verify; none where `base` stopped short of `max_width`
    (rows already cost compute, and its slope extends)."""
    w = world or this_world()
    widths = sorted({n for n in (WIDE_FIRST, batch_width) if max_width < n <= batch_width})
    if not widths or len(base.verify) < max_width:
        return []
    target_seq = SequenceCache(target, slack=max(widths) + 1)
    _fill_context(target_seq, base.context)
    # two timed passes each after one untimed (warming the kernels at these shapes): a 64-row
    # forward can cost ~15 single steps where rows cost compute (this CPU)
    times = _median_times([_forward_timer(target_seq, n) for n in widths], 2, 0.0, agree=w.agree)
    wide = [[n, max(t, base.verify[-1])] for n, t in zip(widths, non_decreasing(times))]
    return w.broadcast_json(wide) if w.active else wide


_recalibrate = False  # set by --recalibrate: each curve is measured afresh once in this process
_measured_here: set = set()


def recalibrate(on: bool = True) -> None:
    """From now on, measure every cost curve asked for once more, ignoring the cache
    (`--recalibrate`; the new curves replace the cached ones), or (on=False) read the cache
    again. Each CLI command sets it, so one invocation's flag never leaks into the next."""
    global _recalibrate
    _recalibrate = on
    _measured_here.clear()


def cache_path() -> Path:
    root = os.environ.get("MLX_SPEC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlx-spec"
    return Path(root) / "costs.json"


def cost_key(target, draft, max_width: int, context: int, ranks: int = 1, batch_width: int = 0) -> str:
    """What changes costs: both models (shapes and dtypes), widths (a batch's too), context,
    MLX version, device, the BLAS MLX's CPU runs with and its threads, and the ranks sharing
    the target."""
    device = str(mx.default_device())
    draft_id = fingerprint(draft) if draft is not None else "none"
    tp = f"|tp{ranks}" if ranks > 1 else ""  # a sharded target costs what its slowest link does
    batch = f"|batch{batch_width}" if batch_width else ""
    info = blas.describe()
    lib = f"{info['name']}:{info['version'] or ''}:{blas.threads_label()}"
    return (f"v4|{fingerprint(target)}|{draft_id}|w{max_width}|ctx{context}|mlx{mx.__version__}|{device}"
            f"|blas={lib}{tp}{batch}")


def load_or_measure(target, draft=None, *, max_width: int = 7, context: int = 256, refresh: bool = False,
                    progress=None, world=None, batch_width: int = 0) -> CostCurve:
    """The cached cost curve for this pair on this machine, measured if missing or stale.
    Across ranks (`world`), rank 0's cache decides and every rank gets rank 0's curve.
    `batch_width`: also priced at the rows a batch reaches: the one-request curve (so a
    request alone in a batch chooses as it would alone), with the wide widths measured
    on top (`measure_batch_widths`) and cached under their own key."""

    w = world or this_world()
    if batch_width:
        base = load_or_measure(target, draft, max_width=max_width, context=context, refresh=refresh,
                               progress=progress, world=w)
        wide = _cached_or_measured(cost_key(target, draft, max_width, context, w.size, batch_width), refresh, w,
                                   lambda: {"wide": measure_batch_widths(target, base, max_width=max_width,
                                                                         batch_width=batch_width, world=w)})
        return replace(base, wide=[[n, max(t, base.verify[-1])] for n, t in wide["wide"]])
    entry = _cached_or_measured(
        cost_key(target, draft, max_width, context, w.size), refresh, w,
        lambda: asdict(measure_costs(target, draft, max_width=max_width, context=context, progress=progress,
                                     world=w)))
    return CostCurve(entry["verify"], entry["draft_step"], entry["context"], entry["draft_step2"])


def _cached_or_measured(key: str, refresh: bool, w, measure: Callable[[], dict]) -> dict:
    """The cache's fresh entry for `key` (rank 0's, across ranks), or `measure()`'s, stored."""
    path = cache_path()
    entry = None
    if w.is_root:
        entry = _read_table(path).get(key)
        fresh = entry and time.time() - entry.get("measured_at", 0) < STALE_AFTER_DAYS * 86400
        forced = refresh or (_recalibrate and key not in _measured_here)
        entry = entry if (fresh and not forced) else None
    if not w.agree(entry is None):
        return w.broadcast_json(entry)
    entry = measure()
    _measured_here.add(key)
    if w.is_root:
        store_curve(path, key, {**entry, "measured_at": time.time()})
    return entry


def _read_table(path: Path) -> dict:
    """The cached curves by key; a missing or damaged file holds none."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def store_curve(path: Path, key: str, entry: dict) -> None:
    """Add one curve to the table at `path`. Processes calibrating at once (a server and a
    `generate`, or two pairs) each read, change and write the whole table: under a lock,
    and read again inside it, so none writes back a table without another's curve."""
    from filelock import FileLock, Timeout

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path.with_suffix(".lock")), timeout=30):
            table = _read_table(path)
            table[key] = entry
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
    except (OSError, Timeout):
        pass  # a read-only cache, or a stuck lock, only costs a re-measurement next time
