"""The suffix drafter's memories in files (`mlx_spec.server.memory_files`), beside the prompt
caches: a memory read back drafts what the one written drafted (checked against that
memory itself, the reference); files that fight back (truncated, flipped, forged with a
fresh digest, another tokenizer's, another scope's, oversized, a folder, a link, a FIFO) are
skipped with one warning line and the memory starts empty; and a file is read only into
the scope it was written for, so one API key's text never reaches another key's memory,
nor the server's shared memory a per-key one, however the files are copied or renamed."""

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.core.cache.files import content_digest, write_safetensors
from mlx_spec.drafters.token_memory import SEPARATOR, Memories
from mlx_spec.server import memory_files
from mlx_spec.server.memory_files import FORMAT, MemoryFiles

VOCAB = 5000
FINGERPRINT = "tokenizer-a"


def requests(seed: int, count: int = 8) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(20, 80))],
             [rng.randrange(VOCAB) for _ in range(rng.randint(20, 80))]) for _ in range(count)]


def filled(folder: Path, scope=None, tokens: int = 100_000, seed: int = 0) -> tuple[Memories, list]:
    """A pool whose `scope` memory remembered `requests(seed)`, persisted to `folder`."""
    memories = Memories(tokens, files=MemoryFiles(folder, FINGERPRINT, VOCAB))
    written = requests(seed)
    for prompt, output in written:
        memories.get(scope).remember(prompt, output)
    memories.persist()
    return memories, written


def restarted(folder: Path, tokens: int = 100_000, fingerprint: str = FINGERPRINT) -> Memories:
    return Memories(tokens, files=MemoryFiles(folder, fingerprint, VOCAB))


def lookups(memory, contexts) -> list:
    """What a drafter sees from `memory` for each context: match lengths and continuations."""
    found = [memory.lookup(c, depth=32, length=6) for c in contexts]
    return [(m.lengths.tolist(), m.follow.tolist()) for m in found]


def contexts_of(written, rng) -> list[list[int]]:
    """Contexts that end inside each remembered request (so they match), and one that does not."""
    out = []
    for prompt, output in written:
        text = prompt + output
        cut = rng.randint(10, len(text) - 1)
        out.append(text[max(0, cut - 20) : cut])
    return out + [[1, 2, 3, 4, 5, 6, 7, 8, 9]]


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


# -- a memory read back -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_a_memory_read_back_drafts_what_the_one_written_did(tmp_path, seed):
    memories, written = filled(tmp_path, seed=seed)
    original = memories.get()
    again = restarted(tmp_path).get()
    assert again is not original and again.held().tolist() == original.held().tolist()
    contexts = contexts_of(written, random.Random(seed))
    assert lookups(again, contexts) == lookups(original, contexts)
    assert any(lengths and max(lengths) >= 8 for lengths, _ in lookups(again, contexts))  # it matches


def test_a_smaller_memory_keeps_the_newest_tokens(tmp_path):
    memories, written = filled(tmp_path)
    small = restarted(tmp_path, tokens=300).get()
    assert len(small) == 300 and small.held().tolist() == memories.get().held()[-300:].tolist()
    newest = written[-1][0] + written[-1][1]
    assert small.lookup(newest[:30], depth=32, length=4).follow[0].tolist() == newest[30:34]


def test_an_evicted_memory_reads_back_its_held_tokens(tmp_path):
    """A ring that wrapped: its oldest request is cut mid-way, and held() starts there."""
    memories, _ = filled(tmp_path, tokens=400)
    assert memories.get().start > 0
    again = restarted(tmp_path, tokens=400).get()
    assert again.held().tolist() == memories.get().held().tolist()


def test_only_what_changed_is_written_again(tmp_path, monkeypatch):
    memories, _ = filled(tmp_path)
    saved = []
    monkeypatch.setattr(memories.files, "save", lambda scope, memory: saved.append(scope) or True)
    memories.persist()
    assert saved == []
    memories.get().remember([1, 2, 3], [4, 5])
    memories.get("a key's digest")  # read (no file): nothing to write
    memories.persist()
    assert saved == [None]


def test_a_failed_write_is_a_warning_and_retried_later(tmp_path, caplog, monkeypatch):
    memories = Memories(1000, files=MemoryFiles(tmp_path, FINGERPRINT, VOCAB))
    memories.get().remember([1, 2, 3], [4, 5])

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memory_files, "write_safetensors", full)
    memories.persist()
    assert any("No space left" in w for w in warnings(caplog)) and not list(tmp_path.iterdir())
    monkeypatch.undo()
    memories.persist()  # still changed since it was last written: written now
    assert restarted(tmp_path).get().held().tolist() == memories.get().held().tolist()


# -- files that fight back --------------------------------------------------------------------

def forge(path: Path, tokens, about: dict, fmt: str = FORMAT, extra: dict | None = None) -> None:
    """A file as an attacker writes it: any content, under a digest recomputed to match."""
    arrays = {"tokens": tokens, **(extra or {})}
    text = json.dumps(about)
    write_safetensors(path, arrays, {"format": fmt, "mlx_spec": text, "digest": content_digest(arrays, text)})


def damage(kind: str, path: Path, files: MemoryFiles) -> None:
    data = path.read_bytes()
    held = mx.array([5, 6, 7, SEPARATOR, 8], mx.int32)
    ours = {"scope": "server", "tokenizer": FINGERPRINT, "tokens": 5}
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "flipped":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    elif kind == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "another format":
        forge(path, held, ours, fmt="mlx-spec/draft-memory/0")
    elif kind == "ids past the vocab":
        forge(path, mx.array([5, VOCAB, 7], mx.int32), ours)
    elif kind == "negative ids":
        forge(path, mx.array([5, -7, 7], mx.int32), ours)
    elif kind == "float tokens":
        forge(path, mx.array([5.0, 6.0], mx.float32), ours)
    elif kind == "2-D tokens":
        forge(path, mx.array([[5, 6], [7, 8]], mx.int32), ours)
    elif kind == "another array":
        forge(path, held, ours, extra={"links": mx.array([1, 2], mx.int32)})
    elif kind == "metadata not an object":
        forge(path, held, ["server", FINGERPRINT])
    elif kind == "oversized":
        forge(path, mx.zeros((memory_files.SLACK_BYTES // 4 + 64 * 1000,), mx.int32), ours)
    elif kind == "a folder":
        path.unlink()
        path.mkdir()
    elif kind == "a link":
        target = path.with_name("elsewhere.safetensors")
        path.rename(target)
        path.symlink_to(target)
    else:
        raise AssertionError(kind)


DAMAGE = ["truncated", "flipped", "garbage", "empty", "another format", "ids past the vocab", "negative ids",
          "float tokens", "2-D tokens", "another array", "metadata not an object", "oversized", "a folder",
          "a link"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_or_forged_file_is_skipped_with_one_warning(tmp_path, caplog, kind):
    memories, _ = filled(tmp_path, tokens=1000)
    path = memories.files.path(None)
    damage(kind, path, memories.files)
    caplog.clear()
    pool = restarted(tmp_path, tokens=1000)
    with caplog.at_level(logging.WARNING, logger="mlx_spec.server"):
        again = pool.get()
    assert len(again) == 0  # starts empty: nothing of the file was taken
    (warned,) = warnings(caplog)
    assert "draft memory" in warned and "\n" not in warned and "Traceback" not in warned
    again.remember([1, 2, 3], [4])
    pool.persist()  # it serves on, and its memory replaces the file (a folder in the way: a warning)
    if kind != "a folder":
        assert restarted(tmp_path, tokens=1000).get().held().tolist() == again.held().tolist()


def test_a_file_of_another_tokenizer_is_skipped(tmp_path, caplog):
    memories, _ = filled(tmp_path)
    other = MemoryFiles(tmp_path, "tokenizer-b", VOCAB)
    assert other.path(None) != memories.files.path(None)  # its own name: never even opened
    other.path(None).write_bytes(memories.files.path(None).read_bytes())  # and renamed to it
    assert len(restarted(tmp_path, fingerprint="tokenizer-b").get()) == 0
    assert any("another tokenizer" in w for w in warnings(caplog))


def test_a_fifo_is_refused_at_once_not_read(tmp_path):
    """A FIFO under the memory's name would block a reader (and the worker thread with
    it). Run in a subprocess, so a regression hangs that process, not this one."""
    files = MemoryFiles(tmp_path, FINGERPRINT, VOCAB)
    os.mkfifo(files.path(None))
    script = textwrap.dedent(f"""
        import logging
        logging.basicConfig(level=logging.WARNING)
        from mlx_spec.server.memory_files import MemoryFiles
        print(MemoryFiles({str(tmp_path)!r}, {FINGERPRINT!r}, {VOCAB}).load(None, 1000))
    """)
    here = str(Path(memory_files.__file__).parents[2])  # the checkout this process imports
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": here})
    assert done.stdout.strip() == "None" and "not a regular file" in done.stderr, done.stdout + done.stderr


# -- scopes -----------------------------------------------------------------------------------

def test_a_key_reads_its_own_file_only(tmp_path):
    first, second = "digest-of-key-a", "digest-of-key-b"
    written_a = filled(tmp_path, scope=first, seed=1)[1]
    pool = restarted(tmp_path)
    prompt, output = written_a[-1]
    found = pool.get(first).lookup(prompt[-20:], depth=32, length=4)
    assert found.follow[0].tolist() == output[:4]  # key a's text, read back for key a
    assert len(pool.get(second)) == 0 and len(pool.get(None)) == 0  # nobody else's
    assert len({pool.files.path(s) for s in (first, second, None)}) == 3


@pytest.mark.parametrize("source, destination", [("digest-of-key-a", "digest-of-key-b"),
                                                 (None, "digest-of-key-b"), ("digest-of-key-a", None)])
def test_a_file_copied_to_another_scope_is_skipped(tmp_path, caplog, source, destination):
    """Key a's memory copied (or renamed) to key b's name, the server's shared one to a
    key's, a key's to the shared one's: each names its own scope inside, under the digest,
    so the reader refuses it, and the destination starts empty."""
    memories, _ = filled(tmp_path, scope=source)
    files = memories.files
    files.path(destination).write_bytes(files.path(source).read_bytes())
    assert len(restarted(tmp_path).get(destination)) == 0
    assert any("another scope" in w for w in warnings(caplog))
    assert len(restarted(tmp_path).get(source)) > 0  # the original still reads back


def test_off_reads_and_writes_no_file(tmp_path):
    filled(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    off = Memories(0, files=MemoryFiles(tmp_path, FINGERPRINT, VOCAB))
    assert off.get() is None and off.get("a key") is None
    off.persist()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
