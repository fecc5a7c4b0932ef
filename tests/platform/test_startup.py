"""A fast start (issue 23): what a warm `mlx-spec generate` imports and parses, checked in
fresh processes (this test process has imported everything already), and the fast-loaded
tokenizer of a GGUF import checked against mlx-lm's own load of the same folder.

No wall-clock limits here: bench/startup.py measures the seconds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from gguf_support import TINY_GGUF_CONFIG, write_tiny_gguf

from mlx_spec.loading.checkpoints import load_folder
from mlx_spec.loading.fast_tokenizer import FastTokenizer
from mlx_spec.loading.tokenizer_loading import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]

# Modules a warm `generate` has no use for; each costs from 0.05 s (huggingface_hub) to
# ~1 s (transformers, through mlx_lm.utils / mlx_lm.tokenizer_utils) to import. NumPy is not
# among them since suffix became the default drafter: its token memory is NumPy arrays (the
# import costs ~40 ms here), imported when the drafter is built, not by the CLI's start.
HEAVY = ("transformers", "huggingface_hub", "mlx_lm.utils", "mlx_lm.tokenizer_utils", "jinja2",
         "fastapi", "uvicorn", "starlette", "matplotlib", "gguf", "httpx")

# Runs the CLI in-process, counting every parse of a tokenizer.json: Python opens of the
# file (mlx-lm and transformers json.load it) and `tokenizers` constructors (Rust reads it).
PROBE = r"""
import builtins, io, json, sys
parses = []
real_open = io.open
def counting_open(file, *args, **kwargs):
    if str(file).endswith("tokenizer.json"):
        parses.append(f"open {file}")
    return real_open(file, *args, **kwargs)
builtins.open = io.open = counting_open
import tokenizers
for name in ("from_file", "from_str", "from_buffer", "from_pretrained"):
    def counted(*args, _real=getattr(tokenizers.Tokenizer, name), _name=name, **kwargs):
        small = _name == "from_str" and len(args[0]) < 4_000_000  # a tokenizer index's small BPE
        parses.append(f"Tokenizer.{_name}" + (" (small)" if small else ""))
        return _real(*args, **kwargs)
    setattr(tokenizers.Tokenizer, name, staticmethod(counted))
from mlx_spec.cli import app
try:
    app(sys.argv[1:])
except SystemExit as exit:
    assert not exit.code, exit.code
heavy = [m for m in json.loads(sys.stdin.read()) if m in sys.modules]
print(json.dumps({"parses": parses, "heavy": heavy}), file=sys.stderr)
"""


def run_python(code: str, *args, env=None, stdin="") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done


def warm_generate(*args, cache: Path) -> dict:
    """Run `generate -n 1 Hello` twice (the first imports and calibrates); the second's
    tokenizer.json parses and the HEAVY modules it imported."""
    command = ["generate", "-n", "1", "Hello", *args]
    env = {"MLX_SPEC_CACHE": str(cache)}
    run_python("from mlx_spec.cli import main; main()", *command, env=env)
    done = run_python(PROBE, *command, env=env, stdin=json.dumps(HEAVY))
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_gguf_path(tmp_path_factory):
    from mlx_spec.testing.tiny import tiny_gemma3

    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3-q8_0.gguf"
    write_tiny_gguf(path, tiny_gemma3(seed=3, **TINY_GGUF_CONFIG))
    return path


@pytest.fixture(scope="module")
def tiny_imported(tiny_gguf_path, tmp_path_factory):
    """The folder our GGUF import writes for the tiny model."""
    from mlx_spec.loading.gguf_import import import_gguf

    return import_gguf(tiny_gguf_path, tmp_path_factory.mktemp("cache"), progress=False)


# ---------------------------------------------------------------------------------------
# Imports
# ---------------------------------------------------------------------------------------


def test_cli_import_leaves_heavy_modules_out():
    done = run_python("import json, sys, mlx_spec.cli; print(json.dumps(sorted(sys.modules)))")
    loaded = set(json.loads(done.stdout))
    assert not [m for m in HEAVY if m in loaded]


def test_mlx_lm_package_init_runs_when_anything_else_needs_it():
    code = """
import sys, types
import mlx_spec.core.cache.sequence, mlx_lm.models.gemma3_text  # model classes: no __init__, no transformers
assert "transformers" not in sys.modules and "mlx_lm.generate" not in sys.modules
import mlx_lm.generate  # any other module: the package __init__ first, as usual
assert "mlx_lm.utils" in sys.modules
from mlx_lm import generate, load
assert callable(generate) and not isinstance(generate, types.ModuleType), generate
import mlx_lm
assert mlx_lm.__version__ and callable(mlx_lm.stream_generate)
"""
    run_python(code)
    run_python("import mlx_spec, mlx_lm; assert callable(mlx_lm.load)")  # attribute first


# A warm run reads the tokenizer index the first run wrote: no parse of tokenizer.json, only
# the small BPE that encodes the prompt and the normalizer's one-line tokenizer.
WARM_PARSES = ["Tokenizer.from_str (small)", "Tokenizer.from_str (small)"]


def test_warm_generate_of_a_gguf_import_parses_no_whole_tokenizer(tiny_gguf_path, tmp_path):
    # --raw as the embedded default's preset: a chat template is rendered by transformers.
    probe = warm_generate("-m", str(tiny_gguf_path), "--raw", cache=tmp_path)
    assert probe["heavy"] == []
    assert probe["parses"] == WARM_PARSES


@pytest.mark.slow
def test_warm_generate_of_the_embedded_model_parses_no_whole_tokenizer(gemma270m, mlx_spec_cache):
    probe = warm_generate(cache=mlx_spec_cache)
    assert probe["heavy"] == []
    assert probe["parses"] == WARM_PARSES


# ---------------------------------------------------------------------------------------
# The fast-loaded model and tokenizer against mlx-lm's own load of the same folder
# ---------------------------------------------------------------------------------------


def test_imported_folder_loads_as_mlx_lm_loads_it(tiny_imported):
    from mlx_lm.utils import load_model

    model, config = load_folder(tiny_imported)
    reference, reference_config = load_model(tiny_imported)
    assert config == reference_config and type(model) is type(reference)
    got, expected = dict(tree_flatten(model.parameters())), dict(tree_flatten(reference.parameters()))
    assert got.keys() == expected.keys()
    assert all(mx.array_equal(got[k], expected[k]).item() and got[k].dtype == expected[k].dtype for k in got)


TEXTS = [
    "Hello", "Hello world", " leading space", "trailing space ", "  two  spaces\n\nand lines\n",
    "\ttabs\tand\r\nCRLF", "Explain speculative decoding in one sentence.",
    "naïve café, Straße, ÆØÅ", "日本語のテキストと中文", "emoji 🤗🚀 and ZWJ 👩‍💻", "Ünïcödé ́combining",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos><eos><pad><unk>",
    "code: def f(x):\n    return x ** 2  # comment", "1234567890 3.14159 -42", "", " ", "\n",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "Más, por favor 🤗"}],
]


def check_same_tokenizer(fast, reference):
    """`fast` (a FastTokenizer, loaded by us) behaves as `reference` (mlx-lm's own
    TokenizerWrapper for the same folder) on everything mlx-spec uses."""
    assert isinstance(fast, FastTokenizer) and fast._full is None
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "chat_template", "has_chat_template", "eos_token_ids"):
        assert getattr(fast, attr) == getattr(reference, attr), attr
    assert len(fast) == len(reference)
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == reference.encode(text, add_special_tokens=special), text
        # issue 32: special tokens' text read as text (transformers' split_special_tokens)
        plain = fast.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert plain == reference.encode(text, add_special_tokens=False, split_special_tokens=True), text
    for token in ("<end_of_turn>", "<start_of_turn>", "<bos>", "▁the", "no such token"):
        assert fast.convert_tokens_to_ids(token) == reference.convert_tokens_to_ids(token)
    # Streaming: the same pieces, token by token, as mlx-lm's detokenizer gives.
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        ours, theirs = fast.detokenizer, reference.detokenizer
        for detokenizer in (ours, theirs):
            detokenizer.reset()
        for token in ids:
            ours.add_token(token)
            theirs.add_token(token)
            assert ours.last_segment == theirs.last_segment, text
        ours.finalize()
        theirs.finalize()
        assert (ours.last_segment, ours.text, ours.tokens) == (theirs.last_segment, theirs.text, theirs.tokens)
    assert fast._full is None  # all of that without transformers
    # The rest is mlx-lm's own wrapper, loaded on first use.
    for chat in CHATS:
        for tokenize in (False, True):
            assert (fast.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)
                    == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize))
    ids = reference.encode(TEXTS[11] + TEXTS[9])
    for skip in (False, True):
        assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert fast._tokenizer.get_vocab() == reference._tokenizer.get_vocab()
    assert fast.eos_token_ids == reference.eos_token_ids


def reference_tokenizer(path: Path, config: dict):
    """mlx-lm's load of the folder with the turn ends mlx-spec adds (as loader does)."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    tokenizer = mlx_lm_load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    tokenizer.add_eos_token("<end_of_turn>")
    return tokenizer


def check_both_loads(path: Path, config: dict, texts=()):
    """A folder's first load (tokenizer.json parsed whole, the index written) and a later
    one (the index: no whole parse) each behave as mlx-lm's own load."""
    import shutil

    from tokenizers import Tokenizer

    from mlx_spec.loading.tokenizer_index import INDEX_DIR, TokenizerIndex

    shutil.rmtree(path / INDEX_DIR, ignore_errors=True)
    reference = reference_tokenizer(path, config)
    first = load_tokenizer(path, config)
    assert isinstance(first._backend, Tokenizer) and (path / INDEX_DIR).is_dir()
    later = load_tokenizer(path, config)
    assert isinstance(later._backend, TokenizerIndex)
    for fast in (first, later):
        check_same_tokenizer(fast, reference)
        for text in texts:
            assert fast.encode(text) == reference.encode(text), text[:80]


def test_fast_tokenizer_of_a_gguf_import_matches_mlx_lm(tiny_imported):
    check_both_loads(tiny_imported, json.loads((tiny_imported / "config.json").read_text()))


@pytest.mark.slow
def test_fast_tokenizer_of_the_embedded_model_matches_mlx_lm(gemma270m):
    from gguf_support import random_texts

    vocabulary = [gemma270m.tokenizer.convert_ids_to_tokens(i) for i in range(0, 262144, 7)]
    texts = random_texts(vocabulary, 150) + [(ROOT / "README.md").read_text()[:20000]]
    check_both_loads(gemma270m.path, gemma270m.config, texts)


def test_an_imported_folder_with_another_decoder_loads_with_mlx_lm(tiny_imported, tmp_path):
    import shutil

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    folder = tmp_path / "byte-level"
    shutil.copytree(tiny_imported, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    assert isinstance(load_tokenizer(folder, json.loads((folder / "config.json").read_text())), TokenizerWrapper)


def test_a_damaged_tokenizer_read_on_the_thread_is_a_one_line_error(tiny_imported, tmp_path):
    import shutil

    from mlx_spec.errors import ModelLoadError
    from mlx_spec.loading import load_model

    folder = tmp_path / "damaged"
    shutil.copytree(tiny_imported, folder)
    (folder / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer in"):
        load_model(str(folder), progress=False)


# ---------------------------------------------------------------------------------------
# The float32 copy: a warm CPU load without the float16 -> float32 cast
# ---------------------------------------------------------------------------------------


def _cast_by_mlx_lm(folder: Path) -> dict:
    """The reference: mlx-lm's own load of the float16 folder, cast to float32."""
    from mlx_lm.utils import load_model

    reference, _ = load_model(folder)
    reference.set_dtype(mx.float32)
    return dict(tree_flatten(reference.parameters()))


def _assert_same_parameters(model, expected: dict):
    got = dict(tree_flatten(model.parameters()))
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert value.dtype == expected[name].dtype, name
        assert mx.array_equal(value, expected[name]).item(), name


def test_a_float32_cpu_load_writes_a_float32_copy_that_later_loads_read(tiny_gguf_path, tmp_path, monkeypatch):
    from mlx_spec.loading.checkpoints import FLOAT32_COPY
    from mlx_spec.loading.loader import load_model

    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    first = load_model(str(tiny_gguf_path), dtype="float32", progress=False)
    folder = first.path
    assert (folder / FLOAT32_COPY / "complete").is_file()
    assert sorted(p.name for p in folder.glob("model*.safetensors")) == ["model.safetensors"]  # float16 kept
    expected = _cast_by_mlx_lm(folder)
    _assert_same_parameters(first.model, expected)
    # Later loads read the copy: float32 straight from the file, before any cast.
    model, _ = load_folder(folder, dtype="float32")
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    _assert_same_parameters(model, expected)
    _assert_same_parameters(load_model(str(tiny_gguf_path), dtype="float32", progress=False).model, expected)
    # Other dtypes read the float16 files as before.
    model, _ = load_folder(folder, dtype="bfloat16")
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float16}


def test_no_float32_copy_for_other_dtypes_and_an_incomplete_one_is_rewritten(tiny_gguf_path, tmp_path,
                                                                            monkeypatch):
    from mlx_spec.loading.checkpoints import FLOAT32_COPY
    from mlx_spec.loading.loader import load_model

    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    folder = load_model(str(tiny_gguf_path), dtype="bfloat16", progress=False).path
    assert not (folder / FLOAT32_COPY).exists()
    # A copy cut short (no "complete"): ignored by the load, then written whole.
    (folder / FLOAT32_COPY).mkdir()
    (folder / FLOAT32_COPY / "model.safetensors").write_bytes(b"cut short")
    loaded = load_model(str(tiny_gguf_path), dtype="float32", progress=False)
    _assert_same_parameters(loaded.model, _cast_by_mlx_lm(folder))
    assert (folder / FLOAT32_COPY / "complete").is_file()
    model, _ = load_folder(folder, dtype="float32")
    _assert_same_parameters(model, _cast_by_mlx_lm(folder))


def test_a_cache_that_cannot_take_the_float32_copy_still_loads(tiny_gguf_path, tmp_path, monkeypatch):
    from mlx_spec.loading import checkpoints, loader

    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    folder = loader.load_model(str(tiny_gguf_path), dtype="bfloat16", progress=False).path

    def disk_full(*args, **kwargs):  # what MLX's safetensors writer raises when a write fails
        raise RuntimeError("[save_safetensors] Failed to write to file")

    monkeypatch.setattr(checkpoints.mx, "save_safetensors", disk_full)
    with pytest.warns(UserWarning, match="could not write a float32 copy"):
        loaded = loader.load_model(str(tiny_gguf_path), dtype="float32", progress=False)
    _assert_same_parameters(loaded.model, _cast_by_mlx_lm(folder))
    assert not (folder / checkpoints.FLOAT32_COPY).exists() and not list(folder.glob(".tmp-*"))


def test_an_import_stored_in_float32_gets_no_second_float32_copy(tiny_gguf_path, tmp_path, monkeypatch):
    from mlx_spec.loading import gguf_tensors
    from mlx_spec.loading.checkpoints import FLOAT32_COPY
    from mlx_spec.loading.loader import load_model

    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_tensors, "STORAGE_DTYPE", mx.float32)
    loaded = load_model(str(tiny_gguf_path), dtype="float32", progress=False)
    assert not (loaded.path / FLOAT32_COPY).exists()
    assert {v.dtype for _, v in tree_flatten(loaded.model.parameters())} == {mx.float32}


# ---------------------------------------------------------------------------------------
# A chat's start: mlx-lm's tokenizer (the chat templates) loads while the first message is typed
# ---------------------------------------------------------------------------------------

CHAT_PROBE = r"""
import builtins, json, sys
from mlx_spec.loading.fast_tokenizer import FastTokenizer
seen = {}
real_preload, real_input = FastTokenizer.load_full_in_background, builtins.input
def preload(self):
    seen["preload"] = {"full loaded": self._full is not None, "mlx_lm.utils": "mlx_lm.utils" in sys.modules}
    return real_preload(self)
def first_input(prompt=""):
    seen.setdefault("prompt", {"preload started": "preload" in seen})
    return real_input(prompt)
FastTokenizer.load_full_in_background, builtins.input = preload, first_input
from mlx_spec.cli import app
try:
    app(sys.argv[1:])
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps(seen), file=sys.stderr)
"""


def test_chat_of_a_gguf_import_prompts_before_mlx_lm_tokenizer_loads(tiny_gguf_path, tmp_path):
    command = ["chat", "-m", str(tiny_gguf_path), "-n", "6", "--gamma", "2"]
    env = {"MLX_SPEC_CACHE": str(tmp_path)}
    run_python("from mlx_spec.cli import main; main()", *command, env=env, stdin="/quit\n")  # imports
    done = run_python(CHAT_PROBE, *command, env=env, stdin="Hello there\n/quit\n")
    seen = json.loads(done.stderr.strip().splitlines()[-1])
    # Nothing had loaded mlx-lm's tokenizer (transformers) when the prompt was first shown.
    assert seen == {"preload": {"full loaded": False, "mlx_lm.utils": False}, "prompt": {"preload started": True}}
    assert "tok/s" in done.stdout and "Traceback" not in done.stderr


def test_a_chat_turn_with_the_tokenizer_loaded_later_equals_mlx_lm(tiny_imported):
    from conftest import chat_turn_matches_plain_decoding
    from mlx_lm import load

    from mlx_spec.apps.conversation import ChatSession
    from mlx_spec.core.engine import Engine
    from mlx_spec.loading import load_model

    loaded = load_model(str(tiny_imported), dtype="float32", progress=False, for_chat="later")
    tokenizer = loaded.tokenizer
    assert isinstance(tokenizer, FastTokenizer) and tokenizer._full is None
    tokenizer.load_full_in_background()
    session = ChatSession(Engine(loaded.model), tokenizer)
    question = "Why is the sky blue?"
    chat_turn_matches_plain_decoding(session, loaded.model, question, max_tokens=12)
    _, reference = load(str(tiny_imported))  # mlx-lm's own tokenizer renders the same prompt
    expected = reference.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    assert session.cache.target.ids[: len(expected)] == list(expected)


def test_a_chat_template_of_an_interactive_chat_is_built_behind_the_prompt(tiny_imported):
    """`chat` on the default preset (`--chat-template qa`): the GGUF import's FastTokenizer
    comes first, holding the template, and mlx-lm's tokenizer, which renders it, is built
    with it later (it was loaded before the prompt showed: 4.2 s instead of 0.8 s to it)."""
    from mlx_spec.loading.chat_templates import QA_CHAT_TEMPLATE
    from mlx_spec.loading.loader import load_model

    template = QA_CHAT_TEMPLATE
    loaded = load_model(str(tiny_imported), dtype="float32", progress=False, for_chat="later",
                        chat_template=template)
    tokenizer = loaded.tokenizer
    assert isinstance(tokenizer, FastTokenizer) and tokenizer._full is None
    assert tokenizer.chat_template == template and tokenizer.has_chat_template
    assert tokenizer.full.chat_template == template  # mlx-lm's, built on first use
    # a template rendered at once (serve, generate) loads mlx-lm's tokenizer with it now
    now = load_model(str(tiny_imported), dtype="float32", progress=False, chat_template=template).tokenizer
    assert not isinstance(now, FastTokenizer) and now.chat_template == template
