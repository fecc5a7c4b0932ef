"""The tokenizer index (mlx_spec/loading/tokenizer_index.py): a small BPE per text must encode
every text exactly as the whole tokenizer.json does, parsed by `tokenizers` itself.

The tokenizers here are trained in-process on this repository's text, Gemma-style (spaces
normalized to ▁, byte fallback, specials and a non-special added token): once with the
trainer's merges (one per token) and once with every pair that makes a token (several per
token, as a SentencePiece conversion such as Gemma's writes).
"""

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
from gguf_support import (  # noqa: F401
    ADDED,
    BEYOND,
    SPECIALS,
    _character,
    random_texts,  # noqa: F401
)
from tokenizers import Tokenizer

from mlx_spec.loading import tokenizer_index
from mlx_spec.loading.fast_tokenizer import FastTokenizer
from mlx_spec.loading.tokenizer_index import INDEX_DIR, TokenizerIndex, open_index

ROOT = Path(__file__).resolve().parents[2]


def _corpus() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "mlx_spec").glob("*.py"))]
    return [f.read_text(encoding="utf-8") for f in files] + ["naïve café Straße 日本語 中文 🤗🚀 ÆØÅ"]


def _tokenizer_json(all_pairs: bool) -> dict:
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=3000, show_progress=False)
    trained.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")  # keeps training fast
    trained.train_from_iterator(_corpus(), trainer)
    learned = json.loads(trained.to_str())["model"]
    tokens = SPECIALS + ADDED + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [t for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if t not in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if all_pairs:  # every split of every token, ordered by the token made (SentencePiece style)
        merges = [[t[:k], t[k:]] for t in tokens[len(SPECIALS) + len(ADDED) + 256:]
                  for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
    else:
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in learned["merges"]]
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": t in SPECIALS} for t in SPECIALS + ADDED]
    added.append({**added[0], "id": len(vocab), "content": BEYOND})
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<bos>": {"id": "<bos>", "ids": [vocab["<bos>"]], "tokens": ["<bos>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


@pytest.fixture(scope="module", params=["trained", "all-pairs"])
def folder(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    (path / "tokenizer.json").write_text(json.dumps(_tokenizer_json(request.param == "all-pairs"), ensure_ascii=False))
    return path



def test_the_index_encodes_every_text_as_the_whole_tokenizer(folder):
    assert tokenizer_index.write(folder)
    index, whole = open_index(folder), Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert isinstance(index, TokenizerIndex)
    tokens = [whole.id_to_token(i) for i in range(whole.get_vocab_size(with_added_tokens=False))]
    texts = random_texts(tokens, 300) + _corpus()[:3] + ["", " ", "▁", "\n", "Hello", "<bos><eos>"]
    for text in texts:
        for special in (True, False):
            assert index.encode(text, add_special_tokens=special).ids == \
                whole.encode(text, add_special_tokens=special).ids, text[:80]
    assert index.get_vocab_size() == whole.get_vocab_size(with_added_tokens=True)
    for token_id in (0, 5, len(tokens) - 1, len(tokens), len(tokens) + 1):
        assert index.id_to_token(token_id) == whole.id_to_token(token_id)
    for token in (*SPECIALS, *ADDED, BEYOND, "▁the", "no such token", "<0x0A>"):
        assert index.token_to_id(token) == whole.token_to_id(token)
    assert index.decoder == json.loads(whole.decoder.__getstate__())


def test_a_text_over_the_limit_is_encoded_by_the_whole_tokenizer(folder, monkeypatch):
    tokenizer_index.write(folder)
    index, whole = open_index(folder), Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = _corpus()[0][:5000]
    monkeypatch.setattr(tokenizer_index, "WHOLE_TEXT_CHARS", 1000)
    assert index.encode(text).ids == whole.encode(text).ids
    assert index._whole is not None  # parsed whole, once
    assert index.encode(text[:500]).ids == whole.encode(text[:500]).ids


def test_a_changed_tokenizer_json_makes_the_index_stale(folder, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    tokenizer_index.write(copy)
    assert open_index(copy) is not None
    data = json.loads((copy / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][: len(data["model"]["merges"]) // 2]  # a different BPE
    (copy / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    assert open_index(copy) is None
    assert tokenizer_index.write(copy)
    whole = Tokenizer.from_file(str(copy / "tokenizer.json"))
    text = _corpus()[0][:3000]
    assert open_index(copy).encode(text).ids == whole.encode(text).ids


def _fast(folder: Path) -> FastTokenizer:
    """The tokenizer a GGUF import's folder loads with: the index where it is fresh, else
    tokenizer.json parsed whole (and the index written)."""
    return FastTokenizer(folder, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>"})


@pytest.mark.parametrize("how", ["cp -p", "rsync -t"])
def test_a_tokenizer_json_replaced_keeping_size_and_mtime_makes_the_index_stale(folder, tmp_path, how):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    source = copy / "tokenizer.json"
    assert tokenizer_index.write(copy) and open_index(copy) is not None
    data = json.loads(source.read_text())
    data["model"]["merges"].reverse()  # another BPE, as many bytes long
    replacement = json.dumps(data, ensure_ascii=False).encode()
    before = source.stat()
    assert len(replacement) == before.st_size and replacement != source.read_bytes()
    if how == "cp -p":  # rewritten in place (the same inode), its times set back
        source.write_bytes(replacement)
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:  # a new file with the old times, renamed over it
        scratch = tmp_path / "scratch.json"
        scratch.write_bytes(replacement)
        os.utime(scratch, ns=(before.st_atime_ns, before.st_mtime_ns))
        os.replace(scratch, source)
    assert (source.stat().st_size, source.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    whole = Tokenizer.from_file(str(source))
    text = _corpus()[0][:3000]
    assert TokenizerIndex(copy).encode(text).ids != whole.encode(text).ids  # what the old index says
    assert open_index(copy) is None
    assert _fast(copy).encode(text) == whole.encode(text).ids  # parsed whole, the index rewritten
    rewritten = _fast(copy)
    assert isinstance(rewritten._backend, TokenizerIndex) and rewritten.encode(text) == whole.encode(text).ids


def test_a_merge_of_byte_fallback_tokens_gets_no_index(folder, tmp_path):
    # "€" is no vocabulary entry: the BPE spells it in byte-fallback tokens <0xE2><0x82><0xAC>,
    # then merges the first two. The token made ("<0xE2><0x82>") is no substring of the text,
    # so a small BPE would lack that merge.
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    assert "€" not in vocab
    vocab["<0xE2><0x82>"] = len(vocab)
    data["added_tokens"][-1]["id"] = len(vocab)  # BEYOND stays numbered after the vocabulary
    data["model"]["merges"].append(["<0xE2>", "<0x82>"])
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    whole = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = ["5 €", "€€ and € <bos>", "naïve café €"]
    assert all(vocab["<0xE2><0x82>"] in whole.encode(text).ids for text in texts)  # the merge applies
    assert not tokenizer_index.write(tmp_path)
    assert not (tmp_path / INDEX_DIR).exists() and open_index(tmp_path) is None
    for text in texts:
        assert _fast(tmp_path).encode(text) == whole.encode(text).ids, text


@pytest.mark.parametrize("damage", ["truncated", "no meta", "bad meta"])
def test_a_damaged_index_is_not_used(folder, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    tokenizer_index.write(copy)
    index = copy / INDEX_DIR
    if damage == "truncated":
        (index / "starts.i32").write_bytes((index / "starts.i32").read_bytes()[:-8])
    elif damage == "no meta":
        (index / "meta.json").unlink()
    else:
        (index / "meta.json").write_text("{")
    assert open_index(copy) is None
    assert tokenizer_index.write(copy) and open_index(copy) is not None  # written anew


@pytest.mark.parametrize("change", [
    ("normalizer", {"type": "Prepend", "prepend": "▁"}),  # adds characters at every segment
    ("pre_tokenizer", {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}),
    ("model.dropout", 0.1),
    ("model.ignore_merges", True),
    ("added id", None),  # an added token whose id is not its vocabulary entry
    ("added beyond", None),  # one after the vocabulary, not numbered as `tokenizers` would
    ("unknown merge", None),  # a merge making a token the vocabulary lacks: no index, no error
])
def test_tokenizers_the_argument_does_not_cover_get_no_index(folder, tmp_path, change):
    data = json.loads((folder / "tokenizer.json").read_text())
    key, value = change
    if key == "added id":
        data["added_tokens"][-2]["id"] = data["added_tokens"][0]["id"]
    elif key == "added beyond":
        data["added_tokens"][-1]["id"] += 1
    elif key == "unknown merge":
        data["model"]["merges"].append(["<td>", "<td>"])
    elif key.startswith("model."):
        data["model"][key.split(".", 1)[1]] = value
    else:
        data[key] = value
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    assert not tokenizer_index.write(tmp_path)
    assert not (tmp_path / INDEX_DIR).exists() and open_index(tmp_path) is None


def test_a_folder_that_cannot_take_an_index_warns_and_leaves_nothing(folder, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / INDEX_DIR, ignore_errors=True)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not tokenizer_index.write(copy)
    assert ["No space left on device" in str(w.message) for w in caught] == [True]
    assert open_index(copy) is None and sorted(p.name for p in copy.iterdir()) == ["tokenizer.json"]
