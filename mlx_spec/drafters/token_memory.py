"""Token memories for suffix drafting: every token seen, and where each short run of them
occurred, so the longest earlier match of the context's last tokens is found in
microseconds (the suffix drafter, `mlx_spec.drafters.suffix`).

A `TokenIndex` holds tokens in arrival order in a ring of `capacity` slots (absolute
position p lives in slot p % capacity; the oldest are evicted first; a growable one, for
one request's context, doubles instead). Sequences are kept apart by a `SEPARATOR`, which
matches nothing and ends every continuation. For each gram length g in `grams` it keeps
LZ77's hash chains (zlib's deflate finds its matches the same way): `heads[g][bucket]` is
1 + the latest position where a g-gram with that hash ends, `links[g][slot]` is 1 + the
position before it in the same bucket (0: none). A lookup walks the chain of the longest g
whose last g context tokens occurred, latest first, at most `limit` steps, and measures
each candidate's match backwards (to `depth` tokens) and its continuation forwards, both in
one NumPy gather.

Invariants and costs:
- a chain only leads backwards; a position below `start` (evicted) ends the walk, so a
  stale bucket or link never yields a wrong candidate, at worst a hash collision, which
  the backwards comparison drops (its match is shorter than g);
- appending costs O(len(grams)) per token plus NumPy's per-call overhead (tens of µs per
  call, whatever the length: commits come a round at a time, requests end whole);
- a lookup costs O(limit · (depth + length)) in one gather, whatever the memory's size;
- memory: 4 bytes a token plus 8 per token per gram length, plus 8 · 2^bucket_bits per
  gram length (~36 MB for a `Memory` of a million tokens, two gram lengths).

Known limit: only the `limit` latest occurrences of the context's last g tokens are
measured, so an older, longer match behind many recent short ones is missed; the longer
grams' chains (rarer, so short) find those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence



class _NumPy:
    """NumPy, imported at first use: every drafter module is imported by the registry, and
    `mlx-spec --help` should not pay NumPy's import (tests/platform/test_startup.py)."""

    def __getattr__(self, name):
        import numpy

        globals()["np"] = numpy  # from now on the module itself
        return getattr(numpy, name)


np = _NumPy()

SEPARATOR = -1
GRAMS = (2, 6, 16)  # chain gram lengths, shortest first
# Earlier requests are matched on 8 tokens at least: a shorter match in a million tokens
# of other text is weak evidence (its drafts cost verify rows and are rarely taken; at an
# answer's start the chat template's 5-6 tokens match every earlier answer's start), and
# its long chains would cost most of a lookup.
MEMORY_GRAMS = (8, 16)
_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: golden ratio · 2^64
_BASE = 1_000_003  # polynomial hash over a gram's tokens
_MASK = (1 << 64) - 1
_FEW = 32  # tokens appended in Python integers below this many, with NumPy from it


@dataclass
class Matches:
    """A lookup's candidates: `ends` the absolute positions where each earlier occurrence
    of the context's suffix ends, `lengths` how many context tokens match there (≤ depth),
    `follow` [len(ends), length] the tokens that followed each (-1 past its end)."""

    ends: np.ndarray
    lengths: np.ndarray
    follow: np.ndarray

    @staticmethod
    def none(length: int) -> "Matches":
        return Matches(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, length), np.int64))


def _gram_hashes(tokens: np.ndarray, g: int) -> np.ndarray:
    """The hash of every g-gram of `tokens` (int64) mod 2^64, by the gram's first index."""
    n = tokens.shape[0] - g + 1
    h = np.zeros(n, np.uint64)
    t = tokens.astype(np.uint64)
    with np.errstate(over="ignore"):
        for j in range(g):
            h = h * np.uint64(_BASE) + t[j : j + n]
    return h


def _gram_hash(gram) -> int:
    """`_gram_hashes` of one gram, in Python integers (cheaper for a few tokens)."""
    h = 0
    for t in gram:
        h = (h * _BASE + t) & _MASK
    return h


class TokenIndex:
    """Tokens with hash chains over their g-grams (see the module).

    Args:
        capacity: tokens held; past it the oldest are evicted (or, `growable`, the ring
            doubles).
        grams: the gram lengths chained.
        bucket_bits: log2 of the buckets per gram length.
        growable: grow instead of evicting (one request's own context).
    """

    def __init__(self, capacity: int, grams: Sequence[int] = GRAMS, bucket_bits: int = 20,
                 growable: bool = False):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity, self.grams, self.growable = capacity, tuple(sorted(grams)), growable
        self.shift = np.uint64(64 - bucket_bits)
        self.multiplier = np.uint64(_MULTIPLIER)
        self.tokens = np.full(capacity, SEPARATOR, np.int32)
        self.heads = {g: np.zeros(1 << bucket_bits, np.int64) for g in self.grams}
        self.links = {g: np.zeros(capacity, np.int64) for g in self.grams}
        self.end = 0  # absolute positions appended
        self.run: list[int] = []  # the last tokens since the last separator (at most max(grams) - 1)

    @property
    def start(self) -> int:
        """The oldest position still held."""
        return max(0, self.end - self.capacity)

    def __len__(self) -> int:
        return self.end - self.start

    def _buckets(self, hashes: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((hashes * self.multiplier) >> self.shift).astype(np.int64)

    def _bucket(self, gram) -> int:
        return ((_gram_hash(gram) * _MULTIPLIER) & _MASK) >> int(self.shift)

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        tokens = np.full(capacity, SEPARATOR, np.int32)
        tokens[: self.end] = self.tokens[: self.end]  # a growable index never evicted: slot = position
        self.tokens, self.capacity = tokens, capacity
        for g in self.grams:
            links = np.zeros(capacity, np.int64)
            links[: self.end] = self.links[g][: self.end]
            self.links[g] = links

    def extend(self, ids: Sequence[int]) -> None:
        """Append `ids` (token ids >= 0) to the current sequence."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size == 0:
            return
        if self.growable and self.end + ids.size > self.capacity:
            self._grow(self.end + ids.size)
        if ids.size > self.capacity:  # only the newest fit
            self.separate()
            ids = ids[-self.capacity :]
        if ids.size < _FEW:
            self._extend_few(ids.tolist())
            return
        n, first = ids.size, self.end
        slots = (first + np.arange(n)) % self.capacity
        self.tokens[slots] = ids
        run = np.concatenate([np.asarray(self.run, np.int64), ids])
        lead = len(self.run)  # run[lead + i] is ids[i]
        for g in self.grams:
            links = self.links[g]
            links[slots] = 0  # the slots' old chains are gone with their tokens
            if run.size < g:
                continue
            # ids[i] ends a g-gram when lead + i >= g - 1
            skip = max(0, g - 1 - lead)
            buckets = self._buckets(_gram_hashes(run[lead + skip - g + 1 :], g))
            positions = first + skip + np.arange(buckets.size)  # where each gram ends
            heads = self.heads[g]
            # Chain the new grams: each links to the previous one in its bucket, from this
            # batch where there is one, else the bucket's head before the batch.
            order = np.argsort(buckets, kind="stable")
            sorted_buckets, sorted_positions = buckets[order], positions[order]
            previous = heads[sorted_buckets].copy()
            same = np.zeros(order.size, bool)
            same[1:] = sorted_buckets[1:] == sorted_buckets[:-1]
            previous[same] = sorted_positions[np.flatnonzero(same) - 1] + 1
            links[sorted_positions % self.capacity] = previous
            last = np.ones(order.size, bool)
            last[:-1] = ~same[1:]
            heads[sorted_buckets[last]] = sorted_positions[last] + 1
        self.end += n
        keep = max(self.grams) - 1
        self.run = run[-keep:].tolist() if keep else []

    def _extend_few(self, ids: list[int]) -> None:
        """`extend` a token at a time, in Python integers: the same chains."""
        run, keep, capacity, tokens = self.run, max(self.grams) - 1, self.capacity, self.tokens
        chains = [(g, self.heads[g], self.links[g]) for g in self.grams]
        for t in ids:
            p = self.end
            slot = p % capacity
            tokens[slot] = t
            run.append(t)
            for g, heads, links in chains:
                if len(run) >= g:
                    bucket = self._bucket(run[-g:])
                    links[slot] = heads[bucket]
                    heads[bucket] = p + 1
                else:
                    links[slot] = 0
            if len(run) > keep:
                del run[: len(run) - keep]
            self.end = p + 1

    def separate(self) -> None:
        """End the current sequence: what follows is another (nothing matches across)."""
        if self.end == 0 or self.tokens[(self.end - 1) % self.capacity] == SEPARATOR:
            self.run = []
            return
        if self.growable and self.end + 1 > self.capacity:
            self._grow(self.end + 1)
        slot = self.end % self.capacity
        self.tokens[slot] = SEPARATOR
        for g in self.grams:
            self.links[g][slot] = 0
        self.end += 1
        self.run = []

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The tokens at absolute `positions` (SEPARATOR where none is held)."""
        positions = np.asarray(positions, np.int64)
        held = (positions >= self.start) & (positions < self.end)
        return np.where(held, self.tokens[positions % self.capacity], SEPARATOR)

    def lookup(self, context: Sequence[int], depth: int, length: int, limit: int = 64,
               periodic: bool = False) -> Matches:
        """The earlier occurrences of `context`'s suffix, by its longest chained gram that
        occurred (at most `limit`, a third of it on the shortest gram's chain; latest
        first), with their match lengths (≤ `depth`) and the `length` tokens after each. `periodic`: `context` is this index's own last
        tokens, so a continuation that runs into the end copies itself (LZ77's overlap: a
        repeated word, a table row), as the n-gram drafter's does."""
        tail = list(context[-depth:])
        for g in reversed(self.grams):
            if len(tail) < g or SEPARATOR in tail[-g:]:
                continue
            bucket = self._bucket(tail[-g:])
            links, start, capacity = self.links[g], self.start, self.capacity
            last = self.end - 1 if periodic else self.end  # the context's own last gram has no follower
            # the shortest gram's chain is long and its matches short: fewer are worth measuring
            most = limit if g != self.grams[0] else max(1, limit // 3)
            ends, p = [], int(self.heads[g][bucket]) - 1
            while p >= start and len(ends) < most:
                if p < last:
                    ends.append(p)
                p = int(links[p % capacity]) - 1
            if not ends:
                continue
            found = self._measure(np.asarray(ends, np.int64), tail, length, periodic)
            keep = found.lengths >= g  # the rest are hash collisions
            if keep.any():
                return Matches(found.ends[keep], found.lengths[keep], found.follow[keep])
        return Matches.none(length)

    def _measure(self, ends: np.ndarray, tail: list[int], length: int, periodic: bool) -> Matches:
        # Few NumPy calls (each costs microseconds, whatever its size): positions before
        # `start` or from `end` hold other tokens, so lengths and continuations are cut there.
        capacity, start, end = self.capacity, self.start, self.end
        wanted = np.asarray(tail[::-1], np.int64)  # the context backwards from its last token
        back = self.tokens[(ends[:, None] - np.arange(wanted.size)) % capacity]
        lengths = np.minimum(np.cumprod(back == wanted, axis=1).sum(axis=1), ends - start + 1)
        offsets = np.arange(length)
        if periodic:
            # past the end, the continuation repeats what lay between the match and the end
            offsets = offsets % np.maximum(end - 1 - ends, 1)[:, None]
        ahead = ends[:, None] + 1 + offsets
        follow = np.where(ahead < end, self.tokens[ahead % capacity], SEPARATOR).astype(np.int64)
        # nothing after a separator belongs to the same sequence
        follow[np.maximum.accumulate(follow == SEPARATOR, axis=1)] = SEPARATOR
        return Matches(ends, lengths, follow)


class Memory(TokenIndex):
    """A `TokenIndex` of earlier requests: each is remembered when it ends (`remember`):
    its prompt, less the longest prefix a recently remembered prompt already had (a
    conversation resent with one more turn adds only that turn), then its output, as one
    sequence. Bounded by `capacity` tokens, the oldest evicted."""

    RECENT_PROMPTS = 64  # remembered prompts whose prefixes a new prompt is compared with
    HEAD = 64  # tokens of a prompt's beginning compared first (cheap), before all of it

    def __init__(self, capacity: int, grams: Sequence[int] = MEMORY_GRAMS, **kwargs):
        super().__init__(capacity, grams, **kwargs)
        self.recent: list[tuple[int, int, int]] = []  # (length, head's hash, hash) of recent prompts

    def remember(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        head = hash(tuple(prompt[: self.HEAD]))
        known = 0
        for size, start, digest in sorted(self.recent, reverse=True):
            if (size <= len(prompt) and hash(tuple(prompt[: min(size, self.HEAD)])) == start
                    and hash(tuple(prompt[:size])) == digest):
                known = size
                break
        self.recent.append((len(prompt), head, hash(tuple(prompt))))
        del self.recent[: -self.RECENT_PROMPTS]
        self.separate()
        # the known prefix's last tokens come again, as context for the new part's first grams
        self.extend(prompt[max(0, known - max(self.grams)):])
        self.extend(output)
        self.separate()

    def held(self) -> np.ndarray:
        """The tokens held, oldest first, SEPARATOR between sequences (int32): what
        `restored` rebuilds this memory from."""
        return self.at(np.arange(self.start, self.end)).astype(np.int32)

    @classmethod
    def restored(cls, held: np.ndarray, capacity: int) -> "Memory":
        """A memory of `capacity` tokens holding `held` (`held()`'s layout; the newest
        `capacity` of them where there are more), its chains rebuilt from the tokens alone:
        nothing but token ids is taken from a file."""
        memory = cls(capacity)
        held = np.asarray(held, np.int64)[-capacity:]
        cuts = np.flatnonzero(held == SEPARATOR)
        begin = 0
        for cut in [*cuts.tolist(), held.size]:
            memory.extend(held[begin:cut])
            if cut < held.size:
                memory.separate()
            begin = cut + 1
        return memory


class Memories:
    """The memories of earlier requests a server (or a chat session) keeps, by scope: one
    `Memory` of `tokens` tokens per scope (None: the one shared memory; a tenant's name:
    its own), made when first asked for. `tokens` 0 keeps none. `files` (a server's
    `memory_files.MemoryFiles`, or None): where each scope's memory is read from when it is
    first asked for, and written to by `persist`, that scope's file only. Not thread-safe:
    the thread that decodes (the server's worker) is the only one that uses it."""

    def __init__(self, tokens: int = 1 << 20, files=None):
        if tokens < 0:
            raise ValueError("the memory's size must be >= 0 tokens")
        self.tokens, self.files = tokens, files
        self.scopes: dict[Hashable, Memory] = {}
        self._saved: dict[Hashable, int] = {}  # scope -> its memory's `end` when last read or written

    def get(self, scope: Hashable = None) -> Optional[Memory]:
        if self.tokens == 0:
            return None
        if scope not in self.scopes:
            memory = self.files.load(scope, self.tokens) if self.files is not None else None
            self.scopes[scope] = Memory(self.tokens) if memory is None else memory
            self._saved[scope] = self.scopes[scope].end
        return self.scopes[scope]

    def persist(self) -> None:
        """Write each memory that changed since it was read or written to its scope's file
        (`files`; failures are its warnings)."""
        if self.files is None:
            return
        for scope, memory in self.scopes.items():
            if memory.end != self._saved.get(scope):
                if self.files.save(scope, memory):
                    self._saved[scope] = memory.end
