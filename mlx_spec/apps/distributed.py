"""Past one machine: the target sharded over `mlx.distributed`, drafting as on one.

Started by `mlx.launch` (ring over TCP/Thunderbolt, JACCL over Thunderbolt 5 RDMA, MPI),
every rank runs the same command. Each loads the target and keeps its tensor-parallel
shard (`models.sharding`); every target forward then costs two all-reduces per layer,
whatever its width, which is why verifying γ+1 tokens at once pays more here than on one
machine. The rules that keep the ranks in lockstep:

  * every rank feeds the target the same tokens: the n-gram drafter is integer code run on
    every rank; a draft model runs on rank 0 only and its tokens are broadcast (lazily, in
    the graph before the verify pass), or it is replicated (`draft_on="all"`);
  * every rank makes the same acceptance decisions: rank 0's verdict (n, token) is
    broadcast in one all-reduce before each round's sync (the engine's `agree` hook);
  * every rank chooses the same γ: the policy is deterministic given the verdicts and the
    cost curve, which rank 0 measures (all ranks running the sharded forwards) and sends;
  * only rank 0 prints and reads stdin; chat input is broadcast to the others;
  * set-up errors are agreed on before any collective (`World.together`): the first rank
    that failed prints one line, the others exit quietly. A rank that dies mid-run makes
    its peers' next collective fail ("connection to a peer was lost"); they exit quietly.

Broadcast over ring is an all-sum in which every rank but 0 contributes zeros (the ring
backend only talks to its neighbours), exact for integers and for floats (x + 0 = x).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import mlx.core as mx

from mlx_spec.cache.forward import text_model
from mlx_spec.core.cost_model import non_decreasing
from mlx_spec.core.verify import Verdict
from mlx_spec.errors import MlxSpecError
from mlx_spec.loading import ModelPair, check_compatible, output_width
from mlx_spec.loading.pairing import _load_as, is_assistant

LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES",
              "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MLX_WORLD_SIZE")
PEER_LOST = "connection to a peer was lost"


class PeerFailed(MlxSpecError):
    """Another rank failed and says so itself; this rank ends without a message."""


@dataclass
class World:
    """The ranks this process runs with; a world of one when not launched by mlx.launch."""

    group: Optional[Any]  # mx.distributed.Group, or None alone

    @property
    def rank(self) -> int:
        return self.group.rank() if self.group is not None else 0

    @property
    def size(self) -> int:
        return self.group.size() if self.group is not None else 1

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    # -- broadcasts from rank 0 ------------------------------------------------------------

    def broadcast(self, x: mx.array) -> mx.array:
        """Rank 0's `x` on every rank, lazily (others pass an array of the same shape and
        dtype; its values are ignored but still computed: if it is the end of a sharded
        forward, every rank must run that forward's collectives, in the same order)."""
        if not self.active:
            return x
        dtype = x.dtype
        wide = x.astype(mx.int32) if dtype in (mx.bool_, mx.uint8, mx.uint16) else x
        mine = mx.where(mx.array(self.is_root), wide, mx.zeros_like(wide))
        return mx.distributed.all_sum(mine, group=self.group).astype(dtype)

    def agree_verdict(self, verdict):
        """The engine's `agree` hook: rank 0's (n, token) on every rank, in one all-reduce
        before the round's sync. Only rank 0 holds q when it alone drafts, and nothing
        promises that other backends or machines compute bit-identical p."""
        packed = self.broadcast(mx.stack([verdict.n.astype(mx.int32), verdict.token.astype(mx.int32)]))
        return Verdict(packed[0], packed[1])

    def broadcast_text(self, text: Optional[str]) -> Optional[str]:
        """Rank 0's `text` (None included: end of input) on every rank."""
        if not self.active:
            return text
        # surrogateescape: undecodable stdin bytes arrive as they left (checked after)
        data = text.encode("utf-8", "surrogateescape") if (self.is_root and text is not None) else b""
        length = self.broadcast(mx.array([len(data) if text is not None or not self.is_root else -1]))
        n = length.item()
        if n < 0:
            return None
        if n == 0:
            return ""
        payload = mx.array(list(data), mx.int32) if self.is_root else mx.zeros((n,), mx.int32)
        return bytes(self.broadcast(payload).tolist()).decode("utf-8", "surrogateescape")

    def broadcast_json(self, obj: Any) -> Any:
        """Rank 0's JSON-able `obj` on every rank (floats arrive bit-exact)."""
        if not self.active:
            return obj
        return json.loads(self.broadcast_text(json.dumps(obj) if self.is_root else None))

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision on every rank (a host sync)."""
        if not self.active:
            return flag
        return bool(self.broadcast(mx.array([int(flag)], mx.int32)).item())

    # -- errors ------------------------------------------------------------------------------

    def check(self, error: Optional[BaseException]) -> None:
        """A collective check point: raise on every rank if any rank failed. The first
        failing rank re-raises its own error (named by rank when it is not rank 0); the
        others raise `PeerFailed`, which the CLI ends with no message."""
        if not self.active:
            if error is not None:
                raise error
            return
        flags = mx.distributed.all_gather(mx.array([int(error is not None)], mx.int32), group=self.group)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if not failed:
            return
        if self.rank != failed[0]:
            raise PeerFailed(f"rank {failed[0]} failed")
        if self.rank != 0:  # this rank's own failure: it reports it
            if isinstance(error, MlxSpecError):
                error = type(error)(f"rank {self.rank}: {error}")
            error.rank_local = True
        raise error

    @contextmanager
    def together(self):
        """Run a block of purely local work (no collectives inside!) and then agree on
        whether it worked on every rank: a bad model path on one rank ends all ranks."""
        try:
            yield
        except Exception as error:
            self.check(error)
            raise
        self.check(None)


@lru_cache(maxsize=1)
def _init() -> World:
    if not any(os.environ.get(name) for name in LAUNCH_ENV):
        return World(None)  # not launched: no backend probing, no waiting for peers
    group = mx.distributed.init()
    return World(group if group.size() > 1 else None)


def world() -> World:
    """This process's `World`: the ranks `mlx.launch` started, or a world of one."""
    return _init()


def quiet_error(error: BaseException) -> bool:
    """Errors that are another rank's to report: `PeerFailed`, or a collective that failed
    because a peer exited."""
    return isinstance(error, PeerFailed) or (isinstance(error, RuntimeError) and PEER_LOST in str(error))


def follow_quietly(w: World, debug: bool = False) -> None:
    """On ranks other than 0: no output, no warnings (rank 0 says it all). A rank's own
    error still reaches `sys.__stderr__`; with `debug`, stderr is left alone."""
    if w.active and not w.is_root:
        sys.stdout = open(os.devnull, "w")
        if not debug:
            sys.stderr = sys.stdout
            warnings.simplefilter("ignore")


# ---------------------------------------------------------------------------------------
# Loading: target sharded, draft on rank 0 (or everywhere)
# ---------------------------------------------------------------------------------------

DRAFT_ON = ("root", "all")


def load_pair(w: World, target: Optional[str], draft: Optional[str] = None, *,
              draft_on: str = "root", draft_options: Optional[dict] = None, **load_kwargs):
    """`models.load_pair` for a world of ranks: every rank loads and shards the target;
    the draft model is loaded on rank 0 only (`draft_on="root"`) or on every rank ("all").
    Loading is local; a failure on any rank ends all of them (see `World.together`).

    Returns:
        A `ModelPair`; on ranks without the draft, `draft` is None and `vocab_size_draft`
        is rank 0's.
    """

    if draft_on not in DRAFT_ON:
        raise MlxSpecError(f"draft_on must be one of {DRAFT_ON}, not {draft_on!r}")
    target_model = draft_model = None
    with w.together():
        target_model = _load_as("target model", target, {**load_kwargs, "group": w.group})
        if draft is not None and (draft_on == "all" or w.is_root):
            # Loaded apart even when it names the target: a sharded model cannot draft alone.
            draft_model = _load_as("draft model", draft, {**load_kwargs, **(draft_options or {})})
            if is_assistant(draft_model):
                raise MlxSpecError("a Gemma 4 MTP assistant drafts from the target's K/V cache, "
                                   "which the ranks split between them: across ranks use "
                                   "--drafter model or ngram")
            check_compatible(target_model, draft_model)
    # Collectives from here on: every rank runs the same forwards.
    vocab_target = output_width(target_model)
    vocab_draft = None
    if draft is not None:
        local = output_width(draft_model) if draft_model is not None else 0
        vocab_draft = int(w.broadcast(mx.array([local], mx.int32)).item())
    return ModelPair(target_model, draft_model, target_model.tokenizer, vocab_target, vocab_draft,
                     draft_on if draft is not None else None)


# ---------------------------------------------------------------------------------------
# Drafting in step
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# What communication costs (for bench)
# ---------------------------------------------------------------------------------------


@dataclass
class CommProfile:
    """All-reduces per target forward (counted in the sharded model) and the measured time
    of one all-reduce of the activations a forward of w positions sends ([1, w, hidden]),
    w = 1..len(latency), best of several chains; `broadcast`: one of a few token ids."""

    ranks: int
    per_forward: int
    latency: list[float]
    broadcast: float

    def per_round(self, width: float) -> float:
        """Seconds of all-reduce in one target forward of `width` positions (interpolated)."""
        i = min(max(width, 1.0), len(self.latency)) - 1
        lo = int(i)
        hi = min(lo + 1, len(self.latency) - 1)
        return self.per_forward * (self.latency[lo] + (i - lo) * (self.latency[hi] - self.latency[lo]))


def all_reduces_per_forward(model) -> int:
    """Sharded-to-all layers (one all-reduce each per forward) and sharded MoE blocks."""
    from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear

    return sum(isinstance(m, (ShardedToAllLinear, QuantizedShardedToAllLinear)) or hasattr(m, "sharding_group")
               for m in model.modules())


def _chain_time(w: World, x: mx.array, chain: int = 16, repeats: int = 5) -> float:
    """Seconds per all-reduce in a chain of dependent ones, as a forward runs them: the
    best of `repeats` chains, the link's own latency (ranks sharing a loaded machine wait
    for each other's time slices too, which a median would count)."""
    import time

    times = []
    for _ in range(repeats + 1):
        w.agree(True)  # start together
        start = time.perf_counter()
        y = x
        for _ in range(chain):
            y = mx.distributed.all_sum(y, group=w.group) * (1.0 / w.size)
        mx.eval(y)
        times.append((time.perf_counter() - start) / chain)
    return min(times[1:])


def comm_profile(w: World, model, max_width: int) -> CommProfile:
    """Count and time the target's all-reduces; every rank gets rank 0's timings."""

    hidden = text_model(model).args.hidden_size
    dtype = next(v.dtype for _, v in _float_params(model))
    latency = [_chain_time(w, mx.ones((1, width, hidden), dtype)) for width in range(1, max_width + 1)]
    broadcast = _chain_time(w, mx.zeros((8,), mx.int32))
    profile = {"latency": non_decreasing(latency), "broadcast": broadcast}  # wider never sends less
    profile = w.broadcast_json(profile)
    return CommProfile(w.size, all_reduces_per_forward(model), profile["latency"], profile["broadcast"])


def _float_params(model):
    from mlx.utils import tree_flatten

    return ((k, v) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
