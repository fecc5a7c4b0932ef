"""Prompt-cache folders and files that fight back (issue 46, items 2 to 5): a full disk, a
folder turned read-only, index entries of the wrong type, a cache file replaced by a folder
or a FIFO, metadata edited behind the digest's back. The contract: a warning, and the
request served from memory or cold (never a 500, never a hang, never a wrong answer). On the
tiny Gemma 3 pair; answers are checked against mlx-lm's own greedy `generate`."""

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import generate, load

from mlx_spec.core.cache import files
from mlx_spec.core.cache.files import CacheFileError, cache_key, load_prompt_cache, save_prompt_cache
from mlx_spec.drafters.model import ModelDrafter
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.server import disk_caches
from mlx_spec.server.cache_pool import CachePool
from mlx_spec.server.disk_caches import INDEX, DiskCaches
from scripted_model import InProcessServer

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

N = 8
TEXTS = ["The committee met on a rainy Tuesday to discuss the budget for next year and then",
         "Dear diary, today I walked along the river and counted seventeen herons standing in"]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    target, tokenizer = load(tiny_dirs[0])
    draft, _ = load(tiny_dirs[1])
    return target, draft, tokenizer


@pytest.fixture(scope="module")
def engine(pair):
    target, draft, tokenizer = pair
    vocab = int(target(mx.array([[0]])).shape[-1])
    return Engine(target, ModelDrafter(draft, vocab), eos_ids=tokenizer.eos_token_ids, context_length=4096)


@pytest.fixture(scope="module")
def key(engine, pair):
    return cache_key(engine, pair[2])


def conversation(pair, engine, text):
    ids = list(pair[2].encode(text))
    cache = engine.make_prompt_cache()
    for _ in engine.rounds(ids, SamplingParams(), gamma=2, max_tokens=N, prompt_cache=cache):
        pass
    return cache


@pytest.fixture(scope="module")
def caches(pair, engine):
    return [conversation(pair, engine, text) for text in TEXTS]


@pytest.fixture
def stored(tmp_path, key, caches):
    """A folder holding the first conversation, and its DiskCaches."""
    disk = DiskCaches(tmp_path, 2**30, key)
    disk.store(caches[0])
    (entry,) = _entries(tmp_path)
    return disk, entry


def _entries(folder: Path) -> list[dict]:
    return json.loads((folder / INDEX).read_text())["entries"]


def _warned(caplog, *words) -> bool:
    return any(all(w in r.getMessage() for w in words) for r in caplog.records if r.levelname == "WARNING")


# -- 3. lookup: errors are warnings, the request is served cold ------------------------------

@pytest.mark.parametrize("field, value", [("tokens", None), ("tokens", "12"), ("bytes", "12"),
                                          ("blocks", None), ("used", "yesterday"), ("file", "../x.safetensors")])
def test_index_entries_of_the_wrong_type_are_ignored(stored, engine, caches, caplog, field, value):
    """Another version sharing the folder (or an edit) wrote an entry whose field has the
    wrong type: it raised TypeError in find (every request a 500 until repaired) or in
    store's budget sum (ending the worker). It is ignored, with a warning."""
    disk, entry = stored
    folder = disk.folder
    (folder / INDEX).write_text(json.dumps({"entries": [{**entry, field: value}]}))
    assert disk.find(engine, caches[0].target.ids, 0) is None
    assert _warned(caplog, "malformed")
    disk.store(caches[1])  # the budget's sum skips it too
    assert disk.find(engine, caches[1].target.ids, 0).target.ids == caches[1].target.ids


def test_a_cache_file_replaced_by_a_folder_is_dropped(stored, engine, caches, caplog):
    """The entry stayed (unlinking a folder raised IsADirectoryError, a 500), so the same
    prompts kept failing. Now: a warning, no cache, and the entry is gone."""
    disk, entry = stored
    path = disk.folder / entry["file"]
    path.unlink()
    path.mkdir()
    assert disk.find(engine, caches[0].target.ids, 0) is None
    assert _warned(caplog, "not a regular file")
    assert _entries(disk.folder) == []


def test_a_full_disk_while_touching_a_read_file_still_serves_it(stored, engine, caches, caplog, monkeypatch):
    disk, entry = stored

    def full(*args):
        raise ENOSPC

    monkeypatch.setattr(disk_caches, "write_text_atomically", full)
    found = disk.find(engine, caches[0].target.ids, 0)
    assert found is not None and found.target.ids == caches[0].target.ids
    assert _warned(caplog, "No space left")


def test_a_folder_turned_read_only_is_a_warning(stored, engine, caches, caplog, monkeypatch):
    """The lock file cannot be opened (EROFS): as this runs as root, file modes would not
    stop it, so the lock's open is made to fail as a read-only mount makes it."""
    disk, entry = stored
    (disk.folder / entry["file"]).write_bytes(b"damaged")  # so find must drop the entry

    def read_only():
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(disk, "_locked", read_only)
    assert disk.find(engine, caches[0].target.ids, 0) is None
    disk.store(caches[1])
    assert _warned(caplog, "Read-only file system")


# -- 2. fit / persist: errors are warnings ----------------------------------------------------

def test_a_full_disk_when_a_stored_conversation_is_evicted_again(stored, caches, caplog, monkeypatch):
    """`store` of a conversation already on disk touches its entry: ENOSPC there escaped
    `CachePool.fit` (the `finally` of every request) and ended the worker."""
    disk, entry = stored
    monkeypatch.setattr(disk_caches, "write_text_atomically", lambda *args: (_ for _ in ()).throw(ENOSPC))
    disk.store(caches[0])
    assert _warned(caplog, "No space left")


def test_persist_writes_the_rest_when_one_fails(tmp_path, key, caches, caplog):
    """At an unload or a stop `persist` stopped at the first error; the rest were lost."""
    disk = DiskCaches(tmp_path, 2**30, key)
    store = disk.store
    tried = []

    def first_fails(cache):
        tried.append(cache)
        if len(tried) == 1:
            raise ENOSPC
        store(cache)

    disk.store = first_fails
    pool = CachePool(None, 2**30, disk)
    pool.caches = list(caches)
    pool.persist()
    assert tried == list(caches)
    assert [e["tokens"] for e in _entries(tmp_path)] == [len(caches[1].target.ids)]
    assert _warned(caplog, "No space left")


def test_a_served_folder_with_a_bad_index_answers_every_request(pair, engine, tmp_path):
    """End to end: an index written by another version (string bytes, null tokens) beside a
    server with a one-byte pool (every older conversation is evicted to disk after each
    answer). Every answer is mlx-lm's; none hangs."""
    target, _, tokenizer = pair
    key_id = files.key_id(cache_key(engine, tokenizer))
    bad = [{"file": f"{key_id}-0.safetensors", "key": key_id, "tokens": None, "bytes": "9", "ids": "x",
            "blocks": [], "used": 0}]
    (tmp_path / INDEX).write_text(json.dumps({"entries": bad}))
    options = ServerOptions(model_name="tiny", gamma="2", context_length=4096, cache_budget=1,
                            prompt_cache_dir=str(tmp_path))
    server = InProcessServer(create_app(engine, tokenizer, options))
    try:
        client = server.client().with_options(timeout=30)
        for text in TEXTS + TEXTS:
            answer = client.completions.create(model="tiny", prompt=text, max_tokens=N, temperature=0)
            assert answer.choices[0].text == generate(target, tokenizer, text, max_tokens=N)
    finally:
        server.stop()


# -- 4. the digest covers the metadata; restored scalars are checked -------------------------

def _rewrite(path: Path, change, digest: bool) -> None:
    """Edit the file's mlx_spec metadata with `change(info)`, arrays untouched; with
    `digest`, the digest is made again as a forger would (the file stays consistent)."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    info = json.loads(metadata["mlx_spec"])
    change(info)
    text = json.dumps(info)
    metadata = {**metadata, "mlx_spec": text}
    if digest:
        metadata["digest"] = files.content_digest(arrays, text)
    files.write_safetensors(path, arrays, metadata)


@pytest.fixture
def saved(tmp_path, caches, key):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches[0], key)
    return path


def _set_target_vocab(info):
    info["target"]["vocab"] = 7


def test_an_edited_vocab_is_refused(saved, engine, key):
    """`"vocab": 7` in the header: every id ≥ 7 was fed as id 0, the answers garbage."""
    _rewrite(saved, _set_target_vocab, digest=False)
    with pytest.raises(CacheFileError, match="digest"):
        load_prompt_cache(saved, engine, key)
    _rewrite(saved, _set_target_vocab, digest=True)
    with pytest.raises(CacheFileError, match="vocab"):
        load_prompt_cache(saved, engine, key)


def _window_layer(info) -> dict:
    return next(layer for layer in info["target"]["layers"] if layer["class"] == "WindowKVCache")


@pytest.mark.parametrize("field, shift", [(3, 1), (3, -1), (2, 1)])  # meta: window, slack, offset, start
def test_a_window_start_or_offset_that_disagrees_with_its_arrays_is_refused(saved, engine, key, caches,
                                                                            field, shift):
    def edit(info):
        layer = _window_layer(info)
        layer["meta"][field] = str(int(layer["meta"][field]) + shift)

    _rewrite(saved, edit, digest=True)
    with pytest.raises(CacheFileError, match="positions") as refused:
        load_prompt_cache(saved, engine, key)
    assert "\n" not in str(refused.value)


def test_a_restored_draft_cache_takes_the_drafters_vocab(saved, engine, key, caches):
    """The draft part's vocab, edited with a consistent digest, is never what feeds ids:
    the drafter sets its own on every request."""
    _rewrite(saved, lambda info: info["draft"].update(vocab=7), digest=True)
    cache, _ = load_prompt_cache(saved, engine, key)
    assert cache.draft_for(engine.drafter.model, None).vocab is None


# -- 5. a FIFO under a cache file's name --------------------------------------------------------

def test_a_fifo_is_refused_at_once_not_read(tmp_path):
    """`mx.load` on a FIFO blocked holding the GIL: the whole process froze (`/health` too).
    Run in a subprocess, so a regression hangs that process, not this one."""
    fifo = tmp_path / "c.safetensors"
    os.mkfifo(fifo)
    script = textwrap.dedent(f"""
        from mlx_spec.core.cache.files import CacheFileError, read_safetensors
        try:
            read_safetensors({str(fifo)!r})
        except CacheFileError as error:
            print(error)
    """)
    here = str(Path(files.__file__).parents[3])  # the checkout whose mlx_spec this process imported
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": here})
    assert "not a regular file" in done.stdout, done.stdout + done.stderr
