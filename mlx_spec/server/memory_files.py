"""The suffix drafter's memories of earlier requests in files, for `serve --prompt-cache-dir`:
a restarted server drafts repeated work from what the last one saw.

One file per memory scope (`--draft-memory`): `draft-memory-<id>.safetensors` beside the
prompt caches, where id is a hash of the scope (the server's one memory, or one API key's:
its digest, `guards.tenant`) and the tokenizer's fingerprint. A file holds one int32 array,
the memory's tokens oldest first with SEPARATOR (-1) between requests (`Memory.held`), and
metadata naming its scope and tokenizer, under one digest over both (`cache.files`'
conventions: written atomically, read without blocking from regular files only).

A file is read only into the scope it names: one key's text never reaches another key's
memory (the timing side channel of docs/server.md's security section) however the files
are named, copied or renamed, nor the server's shared memory a per-key one; "off" reads
and writes none. Nothing but token ids is taken from a file (the hash chains are rebuilt),
each checked to be an id the model has (below its vocab size), so an edited file costs at worst wasted drafts,
which the target rejects: output never depends on it. A file that cannot be used (damaged,
truncated, foreign, another tokenizer's or scope's, oversized, not a regular file) is
skipped with a one-line warning, the memory starting empty; a failed write is a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Hashable, Optional

import mlx.core as mx

from mlx_spec.core.cache.files import (
    CacheFileError,
    content_digest,
    read_safetensors,
    tokenizer_fingerprint,
    write_safetensors,
)
from mlx_spec.drafters.token_memory import SEPARATOR, Memory

log = logging.getLogger("mlx_spec.server")
FORMAT = "mlx-spec/draft-memory/1"
# A file may hold more tokens than this server's memory (an older, larger --draft-memory-tokens:
# the newest are kept), but not without bound: it is read whole.
MAX_BYTES_PER_TOKEN = 64
SLACK_BYTES = 1 << 20


def scope_name(scope: Hashable) -> str:
    """The scope in words, as a file records it: "server", or "key:" and the key's digest."""
    return "server" if scope is None else f"key:{scope}"


class MemoryFiles:
    """The memory files in `folder` for a server whose tokenizer has `fingerprint` and
    whose model's token ids are below `vocab`."""

    def __init__(self, folder, fingerprint: str, vocab: int):
        self.folder = Path(folder).expanduser()
        self.fingerprint, self.vocab = fingerprint, vocab

    @classmethod
    def for_model(cls, folder, model, tokenizer) -> "MemoryFiles":
        """For `model` (its token ids are those its embedding has rows for: mlx-lm's
        `args.vocab_size`, else the tokenizer's ids) and `tokenizer`."""
        vocab = getattr(getattr(model, "args", None), "vocab_size", None)
        if not isinstance(vocab, int) or vocab <= 0:
            vocab = max(tokenizer.get_vocab().values(), default=-1) + 1
        return cls(folder, tokenizer_fingerprint(tokenizer), vocab)

    def path(self, scope: Hashable) -> Path:
        name = json.dumps([FORMAT, scope_name(scope), self.fingerprint])
        return self.folder / f"draft-memory-{hashlib.sha256(name.encode()).hexdigest()[:16]}.safetensors"

    def load(self, scope: Hashable, capacity: int) -> Optional[Memory]:
        """The memory stored for `scope` (its newest `capacity` tokens), or None: no file
        (silently) or one that cannot be used (a warning)."""
        path = self.path(scope)
        try:
            return self._load(path, scope, capacity)
        except FileNotFoundError:
            return None
        except CacheFileError as error:
            log.warning("skipping the draft memory file: %s", error)
        except OSError as error:
            log.warning("skipping the draft memory file %s (%s)", path, error.strerror or error)
        return None

    def _load(self, path: Path, scope: Hashable, capacity: int) -> Memory:
        info = os.lstat(path)  # FileNotFoundError: none yet
        if not stat.S_ISREG(info.st_mode):
            raise CacheFileError(f"{path} is not a regular file")
        if info.st_size > MAX_BYTES_PER_TOKEN * capacity + SLACK_BYTES:
            raise CacheFileError(f"{path} is larger ({info.st_size} bytes) than a memory of {capacity} tokens")
        arrays, metadata = read_safetensors(path)
        if metadata.get("format") != FORMAT or not isinstance(metadata.get("mlx_spec"), str):
            raise CacheFileError(f"{path} is not an mlx-spec draft memory of this version ({FORMAT})")
        if metadata.get("digest") != content_digest(arrays, metadata["mlx_spec"]):
            raise CacheFileError(f"{path} is damaged (its metadata or tokens do not match their digest)")
        try:
            about = json.loads(metadata["mlx_spec"])
        except ValueError:
            raise CacheFileError(f"{path} is damaged (its metadata is not JSON)") from None
        if not isinstance(about, dict):
            raise CacheFileError(f"{path} is damaged (its metadata is not an object)")
        if about.get("tokenizer") != self.fingerprint:
            raise CacheFileError(f"{path} was made with another tokenizer")
        if about.get("scope") != scope_name(scope):
            raise CacheFileError(f"{path} holds another scope's memory, not this one's ({scope_name(scope)})")
        tokens = arrays.get("tokens")
        if set(arrays) != {"tokens"} or tokens.dtype != mx.int32 or tokens.ndim != 1:
            raise CacheFileError(f"{path} is damaged (it holds no 1-D int32 array of tokens alone)")
        held = tokens.tolist()
        if held and not (SEPARATOR <= min(held) and max(held) < self.vocab):
            raise CacheFileError(f"{path} is damaged (it holds ids outside this model's {self.vocab})")
        import numpy as np

        return Memory.restored(np.asarray(held, np.int64), capacity)

    def save(self, scope: Hashable, memory: Memory) -> bool:
        """Write `memory` as `scope`'s file, atomically; False (and a warning) where it
        cannot be written."""
        path = self.path(scope)
        text = json.dumps({"scope": scope_name(scope), "tokenizer": self.fingerprint, "tokens": len(memory)})
        arrays = {"tokens": mx.array(memory.held())}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_safetensors(path, arrays, {"format": FORMAT, "mlx_spec": text,
                                             "digest": content_digest(arrays, text)})
        except OSError as error:
            log.warning("could not write the draft memory to %s: %s", path, error.strerror or error)
            return False
        return True
