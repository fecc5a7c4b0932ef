"""Prompt caches for several conversations at once.

An agent and its summariser, or two editor tabs, alternate requests; with one cache each
switch would prefill everything again. The pool keeps several `PromptCache`s, least recently
used first out, within a memory budget. Each request takes the cache holding the longest
common prefix of its prompt. If that cache holds little beyond the prompt (the same
conversation grown by a turn, perhaps re-rendered a little differently at its end) it is
used as it is, rolling back what differs; if it holds much more (another conversation that
shares a system prompt, or an answer being regenerated), a fork of it is used, so the
conversation it holds survives. A fork shares the arrays until it writes. Every cache
is exact on its own (`mlx_spec.cache`), so which one serves a request never changes an
answer.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

import mlx.core as mx

from mlx_spec.cache.sequence import PromptCache, common_prefix_length

FORK_SURPLUS = 32  # held tokens past the shared prefix worth keeping in a cache of their own


def default_budget() -> int:
    """Half the device memory left free once the models are loaded, at least 256 MiB. A
    Mac's GPU reports its working set; MLX's CPU device reports none, so there it is the
    machine's RAM."""
    info = mx.device_info()
    total = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(256 * 2**20, (total - mx.get_active_memory()) // 2)


class CachePool:
    """Least-recently-used prompt caches within `budget` bytes (both models' KV).

    With `disk` (a `disk_caches.DiskCaches`), evicted caches are written there, and a
    prompt whose longest prefix is held on disk rather than in memory is served from it;
    `engine` is what the files are read for (`make`'s engine)."""

    def __init__(self, make: Callable[[], PromptCache], budget: int, disk=None, engine=None):
        self.make = make
        self.budget = budget
        self.disk = disk
        self.engine = engine
        self.caches: list[PromptCache] = []  # least recently used first
        self.hits = 0  # requests that reused at least one cached token

    def take(self, prompt_ids: list[int], busy: Iterable[PromptCache] = ()) -> PromptCache:
        """The cache to serve `prompt_ids` from, now the most recently used; never one of
        `busy` (those of requests still decoding, which another must not move)."""
        held = prompt_ids[:-1]  # what a prefill leaves in the cache
        busy = {id(cache) for cache in busy}
        best, common = None, 0
        for cache in reversed(self.caches):  # the most recent wins a tie
            if id(cache) in busy:
                continue
            n = common_prefix_length(cache.target.ids, held)
            if n > common:
                best, common = cache, n
        stored = self.disk.find(self.engine, held, common) if self.disk is not None else None
        if stored is not None:  # its file keeps the conversation it holds: no fork needed
            self.hits += 1
            self.caches.append(stored)
            return stored
        if best is None:
            chosen = self.make()
        elif len(best.target.ids) - common <= FORK_SURPLUS:
            self.caches.remove(best)
            chosen = best
        else:
            chosen = best.fork()
        if common:
            self.hits += 1
        self.caches.append(chosen)
        return chosen

    def fit(self, busy: Iterable[PromptCache] = (), used: Optional[PromptCache] = None) -> None:
        """Drop least recently used caches until the pool is within its budget, never one of
        `busy` (a running request's: evicting it would lose what it goes on to decode, and
        writing it to disk would read it mid-round); the most recent one always stays.
        `used`: the cache a request has just finished with, which becomes the most recent
        (with several running at once, take order is not use order)."""
        if used is not None and used in self.caches:
            self.caches.remove(used)
            self.caches.append(used)
        busy = {id(cache) for cache in busy}
        for cache in [c for c in self.caches[:-1] if id(c) not in busy]:  # least recent first
            if self.nbytes <= self.budget:
                break
            self.caches.remove(cache)
            if self.disk is not None:
                self.disk.store(cache)

    def persist(self) -> None:
        """Write every cached conversation to disk (when the server stops)."""
        if self.disk is not None:
            for cache in self.caches:  # the most recent last: the newest on disk, kept longest
                self.disk.store(cache)

    def discard(self, cache: PromptCache) -> None:
        if cache in self.caches:
            self.caches.remove(cache)

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches)
