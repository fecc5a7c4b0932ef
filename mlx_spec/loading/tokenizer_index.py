"""A GGUF import's tokenizer without building its whole BPE: one text's merges at a time.

Building Gemma's BPE (262k tokens, 515k merges) from tokenizer.json takes `tokenizers`
1.1-1.7 s on a 2-core CPU, all of it holding the GIL: the largest piece of a warm
`mlx-spec generate`, which encodes one prompt. A merge only ever joins two adjacent symbols
of one word, so the token it makes is a substring of the normalized text. A BPE model that
holds just the merges making tokens found in a text (in their original order) and the
tokens involved therefore encodes that text exactly as the whole model does:
`TokenizerIndex.encode` builds such a model for each text and `tokenizers` does the
encoding. The index (token strings and merges as int32 arrays, ~60 ms to read) is written
beside tokenizer.json the first time a folder's tokenizer is parsed whole.

Only tokenizers where that argument holds get an index (`_indexable`): a plain BPE, a
normalizer that replaces single characters (or none), pre-tokenizers that only split,
added tokens that are vocabulary entries with the same ids or numbered after them (else
`tokenizers` would number them differently in a small model), and no merge joining a
byte-fallback token (checked in `write`). An index is used while tokenizer.json keeps the
size, mtime, inode and ctime it had when the index was written (`_source_stamp`). Texts over
`WHOLE_TEXT_CHARS` are encoded by the whole tokenizer, parsed once when first needed.
"""

from __future__ import annotations

import json
import warnings
from array import array
from pathlib import Path

from mlx_spec.loading import derived

INDEX_DIR = "tokenizer-index-v1"
_META = "meta.json"  # written last: an index without it is ignored (and rewritten)
_SEPARATOR = "\x00"  # between token strings in tokens.txt; no indexed token contains it
WHOLE_TEXT_CHARS = 30_000  # a 20k-character text takes ~0.35 s this way; a whole parse ~1.2 s


def _source_stamp(tokenizer_json: Path) -> dict:
    """What tells the tokenizer.json an index was made from. Size and mtime alone survive a
    replacement by `cp -p` or `rsync -t`; its ctime does not (a write, a utime or a rename
    sets it to now, and nothing sets it back) and a file renamed over it has a new inode.
    A content hash would do too, but costs every warm load: sha256 of Gemma's 14 MB
    tokenizer.json takes 7.6 ms (10 ms out of the page cache) on a 2-core CPU, a quarter
    more than reading the index (33-51 ms); the stat takes µs. A copied folder gets its
    index rewritten once."""
    stat = tokenizer_json.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino, "ctime_ns": stat.st_ctime_ns}


def _only_splits(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_only_splits(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") in ("Split", "WhitespaceSplit", "Punctuation", "Digits")


def _single_character_replaces(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_single_character_replaces(n) for n in normalizer.get("normalizers", []))
    pattern = normalizer.get("pattern", {})
    return normalizer.get("type") == "Replace" and len(pattern.get("String", "")) == 1


def _indexable(data: dict) -> bool:
    """Whether a tokenizer.json's BPE gives the same ids when cut down to one text's merges."""
    model = data.get("model", {})
    if model.get("type") != "BPE" or model.get("dropout") or model.get("ignore_merges") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False
    if not _single_character_replaces(data.get("normalizer")) or not _only_splits(data.get("pre_tokenizer")):
        return False
    vocab = model.get("vocab", {})
    added_tokens = [added["content"] for added in data.get("added_tokens", [])]
    if sorted(vocab.values()) != list(range(len(vocab))) or any(_SEPARATOR in t for t in [*vocab, *added_tokens]):
        return False
    if model.get("unk_token") is not None and model["unk_token"] not in vocab:
        return False
    # Added tokens are vocabulary entries with the same ids, or come after the vocabulary in
    # order (as `tokenizers` numbers those): a small model holds them all with their ids.
    beyond = [added for added in data.get("added_tokens", []) if added["content"] not in vocab]
    if [added["id"] for added in beyond] != list(range(len(vocab), len(vocab) + len(beyond))):
        return False
    return all(vocab[added["content"]] == added["id"] for added in data.get("added_tokens", [])
               if added["content"] in vocab)


def write(folder: Path) -> bool:
    """Write the index of `folder`'s tokenizer.json, into a temporary folder renamed into
    place. Returns whether there is one now; a tokenizer it does not fit gets none, and a
    folder that cannot take it (read-only, disk full) keeps parsing whole, after a warning.
    Never raises: a tokenizer.json it cannot read as expected just gets no index."""
    source = folder / "tokenizer.json"
    index = folder / INDEX_DIR
    try:
        stamp = _source_stamp(source)
        data = json.loads(source.read_text(encoding="utf-8"))
        if not _indexable(data):
            return False
        model = data["model"]
        tokens = [""] * len(model["vocab"])
        for token, token_id in model["vocab"].items():
            tokens[token_id] = token
        tokens += [added["content"] for added in data["added_tokens"] if added["content"] not in model["vocab"]]
        byte_tokens = {t: i for i, t in enumerate(tokens) if len(t) == 6 and t.startswith("<0x") and t.endswith(">")}
        merges = array("i")
        for merge in model["merges"]:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            # A byte-fallback token stands for a byte of the text, not for its own spelling:
            # a merge joining one makes a token ("<0xE2><0x82>") no substring of the text.
            if left in byte_tokens or right in byte_tokens:
                return False
            merges.extend((model["vocab"][left], model["vocab"][right], model["vocab"][left + right]))
        # The merges' ranks grouped by the token they make: `starts[t]:starts[t + 1]` of
        # `by_result` are the ranks of the merges making token t.
        made = merges[2::3]
        by_result = array("i", sorted(range(len(made)), key=made.__getitem__))
        starts = array("i", [0] * (len(tokens) + 1))
        for token_id in made:
            starts[token_id + 1] += 1
        for token_id in range(len(tokens)):
            starts[token_id + 1] += starts[token_id]
        # The small models always hold the added tokens (so `tokenizers` keeps their ids),
        # the byte-fallback tokens and the unknown token.
        always = {added["content"]: added["id"] for added in data["added_tokens"]}
        always.update(byte_tokens)
        if model.get("unk_token") is not None:
            always[model["unk_token"]] = model["vocab"][model["unk_token"]]
        shell = {**data, "model": {**model, "vocab": always, "merges": []}}

        meta = {"source": stamp, "longest_token": max(map(len, tokens), default=0), "vocab_size": len(tokens),
                "itemsize": array("i").itemsize}

        def fill(scratch: Path) -> None:
            (scratch / "tokens.txt").write_bytes(_SEPARATOR.join(tokens).encode("utf-8"))
            for name, values in (("merges", merges), ("by_result", by_result), ("starts", starts)):
                with open(scratch / f"{name}.i32", "wb") as f:
                    values.tofile(f)
            (scratch / "shell.json").write_text(json.dumps(shell, ensure_ascii=False), encoding="utf-8")
            (scratch / _META).write_text(json.dumps(meta))

        # a stale, incomplete or damaged index is replaced; a good one that landed meanwhile kept
        derived.publish(index, fill, landed=lambda: open_index(folder) is not None)
        return True
    except OSError as error:
        if (index / _META).is_file():
            return True  # lost a race to another process writing the same index
        warnings.warn(f"could not write a tokenizer index in {folder} ({error.strerror or error}); "
                      "its tokenizer keeps being parsed whole (~1 s)", stacklevel=3)
        return False
    except (KeyError, ValueError, TypeError, AttributeError):  # not the BPE layout _indexable expects
        return False


def _fresh(index: Path, source: Path) -> bool:
    try:
        meta = json.loads((index / _META).read_text())
        return meta["source"] == _source_stamp(source) and meta["itemsize"] == array("i").itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return False


def open_index(folder: Path) -> TokenizerIndex | None:
    """`folder`'s index, or None where there is none or tokenizer.json changed since."""
    index = folder / INDEX_DIR
    if not _fresh(index, folder / "tokenizer.json"):
        return None
    try:
        return TokenizerIndex(folder)
    except (OSError, ValueError):
        return None  # damaged: parsed whole (and rewritten) instead


def _read_i32(path: Path) -> array:
    values = array("i")
    values.frombytes(path.read_bytes())
    return values


class TokenizerIndex:
    """The `tokenizers.Tokenizer` calls FastTokenizer makes (encode, token_to_id,
    id_to_token, get_vocab_size), answered from the index; see the module docstring."""

    def __init__(self, folder: Path, encode_special_tokens: bool = False):
        self.encode_special_tokens = encode_special_tokens  # `tokenizers`' flag: specials as text
        index = folder / INDEX_DIR
        meta = json.loads((index / _META).read_text())
        self._folder = folder
        self._tokens = (index / "tokens.txt").read_bytes().decode("utf-8").split(_SEPARATOR)
        self._merges = _read_i32(index / "merges.i32")
        self._by_result = _read_i32(index / "by_result.i32")
        self._starts = _read_i32(index / "starts.i32")
        self._shell = json.loads((index / "shell.json").read_text(encoding="utf-8"))
        self._longest = meta["longest_token"]
        if len(self._tokens) != meta["vocab_size"] or len(self._starts) != len(self._tokens) + 1:
            raise ValueError("tokenizer index does not match its metadata")
        self._ids: dict[str, int] | None = None
        self._normalizer = None
        self._whole = None
        self.decoder = self._shell.get("decoder")  # its JSON form

    @property
    def _token_ids(self) -> dict[str, int]:
        if self._ids is None:
            self._ids = {token: token_id for token_id, token in enumerate(self._tokens)}
        return self._ids

    def token_to_id(self, token: str) -> int | None:
        return self._token_ids.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokens[token_id] if 0 <= token_id < len(self._tokens) else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self._tokens)  # the vocabulary, then the added tokens beyond it (_indexable)

    def whole(self):
        """The whole tokenizer, parsed once (for texts over WHOLE_TEXT_CHARS)."""
        if self._whole is None:
            from tokenizers import Tokenizer

            self._whole = Tokenizer.from_file(str(self._folder / "tokenizer.json"))
            self._whole.encode_special_tokens = self.encode_special_tokens
        return self._whole

    def _normalize(self, text: str) -> str:
        if self._shell.get("normalizer") is None:
            return text
        if self._normalizer is None:
            from tokenizers import Tokenizer

            self._normalizer = Tokenizer.from_str(json.dumps({**self._shell, "added_tokens": []})).normalizer
        return self._normalizer.normalize_str(text)

    def model_for(self, text: str) -> dict:
        """The BPE model (tokenizer.json's "model") that encodes `text` as the whole one does."""
        normalized, ids, longest = self._normalize(text), self._token_ids, self._longest
        found = set()
        for start in range(len(normalized)):
            for end in range(start + 1, min(len(normalized), start + longest) + 1):
                token_id = ids.get(normalized[start:end])
                if token_id is not None:
                    found.add(token_id)
        starts, by_result = self._starts, self._by_result
        ranks = sorted(rank for token_id in found for rank in by_result[starts[token_id]:starts[token_id + 1]])
        tokens, merges = self._tokens, self._merges
        model = self._shell["model"]
        vocab = dict(model["vocab"])
        vocab.update((tokens[token_id], token_id) for token_id in found)
        pairs = [[tokens[merges[3 * rank]], tokens[merges[3 * rank + 1]]] for rank in ranks]
        return {**model, "vocab": vocab, "merges": pairs}

    def encode(self, text: str, add_special_tokens: bool = True):
        """`tokenizers.Tokenizer.encode` of the whole tokenizer (an `Encoding`)."""
        if len(text) > WHOLE_TEXT_CHARS:
            return self.whole().encode(text, add_special_tokens=add_special_tokens)
        from tokenizers import Tokenizer

        small = Tokenizer.from_str(json.dumps({**self._shell, "model": self.model_for(text)}, ensure_ascii=False))
        small.encode_special_tokens = self.encode_special_tokens
        return small.encode(text, add_special_tokens=add_special_tokens)
