"""Prompt caches that outlive the process (issue 29, item 3): cache files, and `serve
--prompt-cache-dir`. On the tiny Gemma 3 pair (sliding window 16, so every conversation here
is past its window); answers are checked against mlx-lm's own greedy `generate`, and the
prefill counts come from the answers' `usage` (cached_tokens)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import generate, load
from scripted_model import InProcessServer
from server_support import wait_for

from mlx_spec.cache.files import CacheFileError, cache_key, load_prompt_cache, save_prompt_cache
from mlx_spec.cache.layers import KVQuantization
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.drafters.model import ModelDrafter
from mlx_spec.server import ServerOptions, create_app
from mlx_spec.server.disk_caches import INDEX, DiskCaches

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, cost_cache, private_cost_cache
pytestmark = pytest.mark.usefixtures("private_cost_cache")

N = 12  # tokens per answer
TEXTS = ["The committee met on a rainy Tuesday to discuss the budget for next year and then",
         "Dear diary, today I walked along the river and counted seventeen herons standing in"]


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    target, tokenizer = load(tiny_dirs[0])
    draft, _ = load(tiny_dirs[1])
    return target, draft, tokenizer


def make_engine(pair, draft=True):
    target, draft_model, tokenizer = pair
    vocab = int(target(mx.array([[0]])).shape[-1])
    drafter = ModelDrafter(draft_model, vocab) if draft else None
    return Engine(target, drafter, eos_ids=tokenizer.eos_token_ids, context_length=4096)


def serve(pair, folder, **options):
    engine = make_engine(pair)
    options = {"model_name": "tiny", "gamma": "2", "context_length": 4096, **options}
    return InProcessServer(create_app(engine, pair[2], ServerOptions(prompt_cache_dir=str(folder), **options)))


def complete(server, prompt):
    return server.client().completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0)


def conversation(pair, engine, text):
    """A PromptCache holding `text` and a greedy answer to it, and the prompt's ids."""
    ids = list(pair[2].encode(text))
    cache = engine.make_prompt_cache()
    for _ in engine.rounds(ids, SamplingParams(), gamma=2, max_tokens=N, prompt_cache=cache):
        pass
    return cache, ids


# -- serve --prompt-cache-dir ----------------------------------------------------------------

def test_a_restarted_server_answers_from_the_disk_cache(pair, tmp_path):
    """The first server answers from memory, drops the first conversation to disk (a pool of
    one byte keeps only the newest) and finds it there again; at its stop it writes the rest.
    A second server on the same folder answers both prompts as the first did and as mlx-lm
    does, with every prompt token but the last read from the cache."""
    target, _, tokenizer = pair
    prompts = [list(tokenizer.encode(text)) for text in TEXTS]
    expected = [generate(target, tokenizer, p, max_tokens=N) for p in prompts]
    first = serve(pair, tmp_path, cache_budget=1)
    try:
        answers = [complete(first, p) for p in prompts]
        assert [a.choices[0].text for a in answers] == expected
        assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
        # the first, evicted once the second answer is done (the worker then fits the pool)
        wait_for(lambda: (tmp_path / INDEX).exists(), 30, "written")
        assert len(json.loads((tmp_path / INDEX).read_text())["entries"]) == 1
        again = complete(first, prompts[0])  # back from disk
        assert again.choices[0].text == expected[0]
        assert again.usage.prompt_tokens_details.cached_tokens == len(prompts[0]) - 1
    finally:
        first.stop()
    second = serve(pair, tmp_path)
    try:
        for prompt, text in zip(prompts, expected):
            answer = complete(second, prompt)
            assert answer.choices[0].text == text
            assert answer.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
        import httpx

        assert httpx.get(second.base.removesuffix("/v1") + "/health").json()["prompt_cache_disk_hits"] == 2
    finally:
        second.stop()


def test_serve_skips_an_unusable_file_with_a_warning(pair, tmp_path, caplog):
    """A stored conversation whose file was damaged afterwards is skipped (logged, deleted)
    and the prompt is prefilled: the answer is still mlx-lm's."""
    target, _, tokenizer = pair
    prompt = list(tokenizer.encode(TEXTS[0]))
    server = serve(pair, tmp_path)
    complete(server, prompt)
    server.stop()  # writes it
    (entry,) = json.loads((tmp_path / INDEX).read_text())["entries"]
    _flip_a_data_byte(tmp_path / entry["file"])
    server = serve(pair, tmp_path)
    try:
        answer = complete(server, prompt)
        assert answer.choices[0].text == generate(target, tokenizer, prompt, max_tokens=N)
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        server.stop()
    assert any("damaged" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    # the damaged file was dropped, and the stop wrote the conversation whole again
    engine = make_engine(pair)
    assert load_prompt_cache(tmp_path / entry["file"], engine, cache_key(engine, tokenizer))[0].target.ids


def test_the_folder_stays_within_its_budget_oldest_out_first(pair, tmp_path):
    engine = make_engine(pair)
    key = cache_key(engine, pair[2])
    caches = [conversation(pair, engine, text)[0] for text in TEXTS]
    one = save_prompt_cache(tmp_path / "probe.safetensors", caches[0], key)
    (tmp_path / "probe.safetensors").unlink()
    disk = DiskCaches(tmp_path / "dir", int(one * 1.5), key)
    for cache in caches:
        disk.store(cache)
    entries = json.loads((tmp_path / "dir" / INDEX).read_text())["entries"]
    assert [e["tokens"] for e in entries] == [len(caches[1].target.ids)]  # the newest stayed
    assert sorted(p.name for p in (tmp_path / "dir").glob("*.safetensors")) == [entries[0]["file"]]
    assert disk.find(engine, caches[0].target.ids, 0) is None
    assert disk.find(engine, caches[1].target.ids, 0).target.ids == caches[1].target.ids


# -- cache files: refused when they do not fit -----------------------------------------------

def _flip_a_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last array, past the header
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(pair, tmp_path):
    engine = make_engine(pair)
    key = cache_key(engine, pair[2])
    cache, _ = conversation(pair, engine, TEXTS[0])
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, cache, key)
    return engine, key, cache, path


def test_a_cache_file_round_trips(saved):
    engine, key, cache, path = saved
    loaded, _ = load_prompt_cache(path, engine, key)
    assert loaded.target.ids == cache.target.ids and loaded.draft.ids == cache.draft.ids
    for mine, theirs in zip(loaded.target.cache, cache.target.cache):
        assert type(mine) is type(theirs) and mine.offset == theirs.offset
        assert mx.array_equal(mine.state[0], theirs.state[0][..., : mine.state[0].shape[2], :])


def test_damaged_truncated_and_foreign_files_are_refused(saved, tmp_path):
    engine, key, cache, path = saved
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

    foreign = make_prompt_cache(engine.target)
    engine.target(mx.array([[2, 3, 4]]), cache=foreign)
    mlx_lm_save(str(tmp_path / "f.safetensors"), foreign)
    whole = path.read_bytes()
    damages = [("damaged", _flip_a_data_byte), ("not a readable safetensors",
                                                 lambda p: p.write_bytes(whole[:-100])),
               ("not a readable safetensors", lambda p: p.write_bytes(b"\x00" * 50)),
               ("not an mlx-spec prompt cache",
                lambda p: p.write_bytes((tmp_path / "f.safetensors").read_bytes()))]
    for words, damage in damages:
        path.write_bytes(whole)
        damage(path)
        with pytest.raises(CacheFileError, match=words) as refused:
            load_prompt_cache(path, engine, key)
        assert "\n" not in str(refused.value)


def test_files_of_another_model_or_kv_bits_are_refused(saved, pair):
    engine, key, cache, path = saved
    target, draft, tokenizer = pair
    other = Engine(draft, None, eos_ids=tokenizer.eos_token_ids)  # the draft's weights as target
    with pytest.raises(CacheFileError, match="another model"):
        load_prompt_cache(path, other, cache_key(other, tokenizer))
    quantized = Engine(target, engine.drafter, eos_ids=tokenizer.eos_token_ids, kv=KVQuantization(8))
    with pytest.raises(CacheFileError, match="other --kv-bits"):
        load_prompt_cache(path, quantized, cache_key(quantized, tokenizer))
    bigger = Engine(target, engine.drafter, eos_ids=tokenizer.eos_token_ids, max_gamma=engine.max_gamma + 1)
    with pytest.raises(CacheFileError, match="another rollback slack"):
        load_prompt_cache(path, bigger, cache_key(bigger, tokenizer))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_cache_file_round_trips_and_answers_as_before(pair, tmp_path, bits):
    """--kv-bits caches (packed K/V triples, sliding windows included) survive a file: the
    conversation continued from the file answers as the one continued in memory."""
    target, _, tokenizer = pair
    engine = Engine(target, make_engine(pair).drafter, eos_ids=tokenizer.eos_token_ids, context_length=4096,
                    kv=KVQuantization(bits, group_size=32), draft_kv=KVQuantization(bits, group_size=32))
    key = cache_key(engine, tokenizer)
    cache, ids = conversation(pair, engine, TEXTS[0])
    assert any(getattr(layer, "bits", None) == bits for layer in cache.target.cache)
    save_prompt_cache(tmp_path / "q.safetensors", cache, key)
    loaded, _ = load_prompt_cache(tmp_path / "q.safetensors", engine, key)
    follow = cache.target.ids + list(tokenizer.encode(" and then", add_special_tokens=False))

    def answer(prompt_cache):
        return [t for r in engine.rounds(follow, SamplingParams(), gamma=2, max_tokens=N, prompt_cache=prompt_cache)
                for t in r.tokens]

    assert answer(loaded) == answer(cache)


def test_a_changed_draft_loses_only_its_own_part(saved, pair):
    engine, key, cache, path = saved
    plain = make_engine(pair, draft=False)
    loaded, _ = load_prompt_cache(path, plain, cache_key(plain, pair[2]))
    assert loaded.target.ids == cache.target.ids and loaded.draft is None


# -- writes: a full disk, two processes -----------------------------------------------------

WRITER = textwrap.dedent("""
    import logging, resource, signal, sys, json
    import mlx_spec
    import mlx.core as mx
    from mlx_lm import load
    from mlx_spec.cache.files import cache_key
    from mlx_spec.drafters.model import ModelDrafter
    from mlx_spec.core.engine import Engine
    from mlx_spec.core.sampling import SamplingParams
    from mlx_spec.server.disk_caches import DiskCaches

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
    target_dir, draft_dir, folder, limit, texts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
    target, tokenizer = load(target_dir)
    draft, _ = load(draft_dir)
    engine = Engine(target, ModelDrafter(draft, int(target(mx.array([[0]])).shape[-1])), eos_ids=tokenizer.eos_token_ids)
    disk = DiskCaches(folder, 2**40, cache_key(engine, tokenizer))
    if limit:  # files may not grow past `limit` bytes: a write past it fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    for text in texts:
        cache = engine.make_prompt_cache()
        for _ in engine.rounds(list(tokenizer.encode(text)), SamplingParams(), gamma=2, max_tokens=4, prompt_cache=cache):
            pass
        disk.store(cache)
    print("done")
""")


def _writer(tiny_dirs, folder, texts, limit=0):
    return subprocess.Popen([sys.executable, "-c", WRITER, *tiny_dirs, str(folder), str(limit), json.dumps(texts)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_failed_write_is_a_warning_and_leaves_no_file(tiny_dirs, tmp_path):
    """A write past the file-size limit (as a full disk fails) is logged; the process goes
    on, and the folder holds neither a half file nor an index entry for it."""
    writer = _writer(tiny_dirs, tmp_path, TEXTS[:1], limit=20_000)
    out, _ = writer.communicate(timeout=120)
    assert writer.returncode == 0 and out.strip().endswith("done"), out
    assert "WARNING could not write a cached conversation" in out and "Traceback" not in out
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*.tmp"))
    assert not (tmp_path / INDEX).exists()


def test_two_processes_writing_one_folder_lose_nothing(tiny_dirs, pair, tmp_path):
    """Two processes store conversations into one folder at once (one of them the same in
    both): afterwards the index names every distinct one, once, and every file loads."""
    words = ["apples", "rivers", "engines", "violins"]
    texts = [f"A long list of {w} and more {w}, counted one by one in the old ledger," for w in words]
    writers = [_writer(tiny_dirs, tmp_path, texts[:2] + texts[-1:]), _writer(tiny_dirs, tmp_path, texts[2:])]
    for writer in writers:
        out, _ = writer.communicate(timeout=180)
        assert writer.returncode == 0 and "Traceback" not in out, out
    entries = json.loads((tmp_path / INDEX).read_text())["entries"]
    assert len(entries) == len(texts) == len({e["file"] for e in entries})
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(e["file"] for e in entries)
    engine = make_engine(pair)
    key = cache_key(engine, pair[2])
    for entry in entries:
        loaded, _ = load_prompt_cache(tmp_path / entry["file"], engine, key)
        assert len(loaded.target.ids) == entry["tokens"]


# -- chat --save / --resume ------------------------------------------------------------------

def test_a_resumed_chat_prefills_only_its_new_turn(pair, tmp_path):
    """Save a session after one turn, resume it in a new ChatSession: its next turn gives
    mlx-lm's greedy answer to the whole conversation (`chat_turn_matches_plain_decoding`),
    the same answer and the same prefill count as the first session continuing, and that
    count is the new turn's tokens only (nothing said before is prefilled again)."""
    from conftest import chat_turn_matches_plain_decoding

    from mlx_spec.apps.conversation import ChatSession

    target, _, tokenizer = pair
    engine = make_engine(pair)
    key = cache_key(engine, tokenizer)
    first = ChatSession(engine, tokenizer, system="Be brief.")
    chat_turn_matches_plain_decoding(first, target, "Tell me about rivers and the sea")
    first.save(tmp_path / "s.safetensors", key)
    resumed = ChatSession(make_engine(pair), tokenizer)
    resumed.resume(tmp_path / "s.safetensors", key)
    assert resumed.messages == first.messages and resumed.ids == first.ids
    held = len(resumed.cache.target.ids)
    new_stats = chat_turn_matches_plain_decoding(resumed, target, "And the lakes?")
    old_stats = chat_turn_matches_plain_decoding(first, target, "And the lakes?")
    assert resumed.ids == first.ids  # the same answer
    turn = len(resumed.prompt_ids) - 1 - held  # prompt tokens after what the cache held
    assert 0 < turn < held and new_stats.prefill_tokens == old_stats.prefill_tokens
    assert new_stats.prefill_tokens <= 2 * turn + 1  # both models: the new turn (the draft one more)


def _answers(out: str) -> list[str]:
    """The answers in a piped chat's output: the text after each prompt, up to its footer."""
    return [part.split("\n[")[0] for part in out.split(">>> ")[1:] if "\n[" in part]


def test_chat_save_and_resume(models, tmp_path, monkeypatch):
    from cli_support import assert_one_line_error, assert_usage_error, invoke

    monkeypatch.setenv("MLX_SPEC_SESSIONS", str(tmp_path / "sessions"))
    flags = ["chat", *models, "-n", "10", "--gamma", "2", "--temp", "0"]
    both = invoke(flags, input="Hello there\nAnd now?\n")
    assert both.exit_code == 0, both.stderr
    saved = invoke([*flags, "--save", "one"], input="Hello there\n")
    assert saved.exit_code == 0 and "session saved as 'one'" in saved.stdout, saved.stderr
    assert (tmp_path / "sessions" / "one.safetensors").exists()
    resumed = invoke([*flags, "--resume", "one"], input="And now?\n/stats\n")
    assert resumed.exit_code == 0, resumed.stderr
    assert "resumed session 'one': 1 turn" in resumed.stdout
    assert len(_answers(both.stdout)) == 2 and all(_answers(both.stdout))
    assert _answers(resumed.stdout) == _answers(both.stdout)[1:]
    assert_one_line_error(invoke([*flags, "--resume", "nobody"]), "no saved chat session 'nobody'")
    assert_usage_error(invoke([*flags, "--save", "../up"]), "not a session name")
    (tmp_path / "sessions" / "one.safetensors").write_bytes(b"\x00" * 40)
    assert_one_line_error(invoke([*flags, "--resume", "one"]), "cannot resume session 'one'")
    other = ["chat", "--model", models[3], "-n", "4", "--drafter", "none"]  # the draft as target
    invoke([*flags, "--save", "one"], input="Hello there\n")
    assert_one_line_error(invoke([*other, "--resume", "one"]), "another model")


def test_a_failed_save_is_a_warning(models, tmp_path, monkeypatch):
    """A full disk at `chat --save`: one warning line, exit 0, no file and no temp file left."""
    import errno
    import os

    from cli_support import invoke

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setenv("MLX_SPEC_SESSIONS", str(tmp_path))
    monkeypatch.setattr(os, "fsync", full)
    result = invoke(["chat", *models, "-n", "4", "--save", "full"], input="Hello\n")
    assert result.exit_code == 0, result.stderr
    assert "warning: could not save session 'full': No space left on device" in result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.iterdir())


def test_serve_refuses_a_folder_it_cannot_write(tmp_path):
    from cli_support import assert_usage_error, invoke

    taken = tmp_path / "a-file"
    taken.write_text("")
    assert_usage_error(invoke(["serve", "--prompt-cache-dir", taken]), "--prompt-cache-dir", "cannot create it")
