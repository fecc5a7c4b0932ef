"""Cached conversations in a folder, for `serve --prompt-cache-dir`: the pool writes a
conversation's caches here when it evicts it or the server stops, and a later server (or
another one sharing the folder) finds them by prefix as it finds the ones in memory.

Lookup reads one small index, never the cache files: each entry lists chained hashes of
its ids in blocks of `BLOCK` tokens and a hash of all of them, so the entry sharing the
longest prefix with a prompt is found from the prompt's own hashes; only that file is read.
The index is changed under an exclusive `flock` on `.lock` and replaced atomically; cache
files are written beside it atomically (`cache.files.write_safetensors`) before the index
names them, so two processes sharing the folder never see half a file or a lost entry.
The folder's files stay within a byte budget, least recently used out first. A file that
cannot be used (damaged, or made by another model) is skipped with a warning and deleted,
and a failed write (a full disk) is a warning; neither ever stops a request.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from mlx_spec.cache.files import (
    CacheFileError,
    key_id,
    load_prompt_cache,
    save_prompt_cache,
    write_text_atomically,
)
from mlx_spec.cache.sequence import PromptCache, common_prefix_length

log = logging.getLogger("mlx_spec.server")
BLOCK = 16  # tokens per prefix hash
INDEX = "index.json"
STALE_TEMP_S = 3600  # a temp file this old was left by a process that died mid-write


def _ids_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:32]


def block_hashes(ids: list[int]) -> list[str]:
    """Chained hashes of ids' whole blocks: the k-th stands for ids[: (k + 1) * BLOCK]."""
    hashes, chain = [], b""
    for begin in range(0, len(ids) - BLOCK + 1, BLOCK):
        chain = hashlib.sha256(chain + json.dumps(ids[begin : begin + BLOCK]).encode()).digest()[:16]
        hashes.append(chain.hex())
    return hashes


class DiskCaches:
    """A folder of cached conversations for one model (`key`: `cache.files.cache_key`),
    at most `budget` bytes of cache files (other models' files in the folder count too)."""

    def __init__(self, folder, budget: int, key: dict):
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self.key = key
        self.id = key_id(key)
        self.hits = 0
        self._sweep_temps()

    # -- the index ------------------------------------------------------------------------

    @contextmanager
    def _locked(self):
        with open(self.folder / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_index(self) -> list[dict]:
        try:
            entries = json.loads((self.folder / INDEX).read_text())["entries"]
            return [e for e in entries if isinstance(e, dict) and {"file", "key", "tokens", "bytes"} <= set(e)]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("prompt cache index %s unreadable (%s); starting a new one",
                        self.folder / INDEX, type(error).__name__)
            return []

    def _write_index(self, entries: list[dict]) -> None:
        write_text_atomically(self.folder / INDEX, json.dumps({"entries": entries}))

    def _drop(self, entries: list[dict], entry: dict) -> None:
        entries.remove(entry)
        (self.folder / entry["file"]).unlink(missing_ok=True)

    def _sweep_temps(self) -> None:
        now = time.time()
        for temp in self.folder.glob(".*.tmp"):
            try:
                if now - temp.stat().st_mtime > STALE_TEMP_S:
                    temp.unlink()
            except OSError:
                pass

    # -- lookup and storage ---------------------------------------------------------------

    def find(self, engine, held: list[int], better_than: int) -> Optional[PromptCache]:
        """The stored conversation sharing the longest prefix with `held`, read from its
        file, if that prefix is longer than `better_than` tokens; else None."""
        entries = [e for e in self._read_index() if e["key"] == self.id]
        ours = block_hashes(held)
        best, best_n = None, better_than
        for entry in sorted(entries, key=lambda e: -e.get("used", 0)):  # the most recent wins a tie
            n = BLOCK * common_prefix_length(ours, entry.get("blocks", []))
            if entry["tokens"] <= len(held) and _ids_hash(held[: entry["tokens"]]) == entry.get("ids"):
                n = entry["tokens"]  # the whole stored conversation is a prefix of the prompt
            if n > best_n:
                best, best_n = entry, n
        if best is None:
            return None
        path = self.folder / best["file"]
        try:
            cache, _ = load_prompt_cache(path, engine, self.key)
        except CacheFileError as error:
            log.warning("skipping a cached conversation: %s", error)
            with self._locked():
                entries = self._read_index()
                for entry in [e for e in entries if e["file"] == best["file"]]:
                    self._drop(entries, entry)
                self._write_index(entries)
            return None
        self.hits += 1
        self._touch(best["file"])
        return cache

    def _touch(self, name: str) -> None:
        with self._locked():
            entries = self._read_index()
            for entry in entries:
                if entry["file"] == name:
                    entry["used"] = time.time()
            self._write_index(entries)

    def store(self, cache: PromptCache) -> None:
        """Write `cache`'s conversation to the folder (unless it is there already), drop the
        stored ones it extends, and keep the folder within its budget. A failed write is
        logged, never raised."""
        ids = cache.target.ids
        if not ids or cache.target.unsettled:
            return
        if not all(type(t) is int for t in ids):  # image keys (id, hash): the file cannot hold the images
            return
        digest = _ids_hash(ids)
        name = f"{self.id}-{digest[:16]}.safetensors"
        if any(e["file"] == name and e["key"] == self.id for e in self._read_index()) \
                and (self.folder / name).exists():
            self._touch(name)
            return
        try:
            size = save_prompt_cache(self.folder / name, cache, self.key)
        except (OSError, CacheFileError) as error:
            log.warning("could not write a cached conversation to %s: %s", self.folder,
                        getattr(error, "strerror", None) or error)
            return
        entry = {"file": name, "key": self.id, "tokens": len(ids), "bytes": size, "ids": digest,
                 "blocks": block_hashes(ids), "used": time.time()}
        try:
            with self._locked():
                entries = [e for e in self._read_index() if e["file"] != name]
                for old in [e for e in entries if e["key"] == self.id and e["tokens"] <= len(ids)
                            and _ids_hash(ids[: e["tokens"]]) == e.get("ids")]:
                    self._drop(entries, old)  # a prefix of this conversation: it serves no prompt better
                entries.append(entry)
                entries.sort(key=lambda e: e.get("used", 0))
                while entries and sum(e["bytes"] for e in entries) > self.budget:
                    self._drop(entries, entries[0])
                self._write_index(entries)
        except OSError as error:
            log.warning("could not update the prompt cache index in %s: %s", self.folder,
                        error.strerror or error)
