"""The tokenizer of a folder our GGUF import wrote, from one parse of its tokenizer.json.

mlx-lm's `load_tokenizer` costs ~3.7 s of a warm `mlx-spec generate` on a 2-core CPU for
Gemma's 262k-token vocabulary: the tokenizer.json is parsed three times (mlx-lm reads it
to pick a streaming detokenizer, transformers reads it for its added tokens, then the
`tokenizers` backend parses it), the vocabulary is copied out three times, and
transformers itself takes ~1 s to import. `FastTokenizer` has mlx-lm's `TokenizerWrapper`
interface; what generation needs (encode, token ids, special tokens, EOS ids, the
streaming detokenizer) comes straight from the `tokenizers` backend, and everything else
(chat templates, decode, `_tokenizer` ...) from mlx-lm's own `TokenizerWrapper` for the same
folder, loaded on first use. tests/platform/test_startup.py checks both halves against mlx-lm's load.

Only folders whose tokenizer is a plain `PreTrainedTokenizerFast` over tokenizer.json with
a SentencePiece-style decoder qualify (`fast_loadable`); our GGUF import writes them so.
Where the folder has a tokenizer index (`tokenizer_index`, written on the first load), the
backend is that index: no whole parse of tokenizer.json at all.
"""

from __future__ import annotations

import json
import threading
from functools import cached_property
from pathlib import Path

from mlx_spec.loading import tokenizer_index

_SPM_DECODER = [  # mlx-lm's _is_spm_decoder_no_space; with a final Strip it is _is_spm_decoder
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


class NotSentencePiece(ValueError):
    """The tokenizer's decoder is not one FastTokenizer streams: load it with mlx-lm."""


def fast_loadable(path: Path) -> dict | None:
    """The tokenizer_config.json of `path` if FastTokenizer can load the folder, else None."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    plain = config.get("tokenizer_class") == "PreTrainedTokenizerFast"
    # Keys that change how transformers or mlx-lm build the tokenizer: leave those to them.
    special = {"chat_template_type", "tool_parser_type", "added_tokens_decoder", "auto_map",
               "split_special_tokens", "fast_tokenizer_files"}
    if not plain or special & config.keys() or not (path / "tokenizer.json").is_file():
        return None
    return config


class FastTokenizer:
    """mlx-lm's `TokenizerWrapper` behaviour for a `fast_loadable` folder (module docstring).

    Args:
        path: the model folder.
        config: its tokenizer_config.json (from `fast_loadable`).
        eos_token_ids: the model config's EOS ids (mlx-lm's `eos_token_ids`).
    Raises:
        NotSentencePiece: the tokenizer's decoder is not SentencePiece-style.
    """

    def __init__(self, path: Path, config: dict, eos_token_ids=None, chat_template: str | None = None):
        self._full = None
        self._full_lock = threading.Lock()
        self._path = Path(path)
        # a chat template in place of the stored one (`read_tokenizer`'s): the full
        # tokenizer, which renders it, is built with it whenever it is first needed
        self._config = config if chat_template is None else {**config, "chat_template": chat_template}
        self._template_override = chat_template
        # The index answers without building the whole BPE (~1.5 s); the first load of a
        # folder parses tokenizer.json whole and writes the index for the next ones.
        self._backend = tokenizer_index.open_index(self._path)
        if self._backend is not None:
            decoder = self._backend.decoder
        else:
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_file(str(self._path / "tokenizer.json"))
            decoder = json.loads(self._backend.decoder.__getstate__()) if self._backend.decoder else None
            tokenizer_index.write(self._path)
        if decoder is None or decoder.get("decoders") not in (_SPM_DECODER, [*_SPM_DECODER, _STRIP]):
            raise NotSentencePiece(f"decoder {decoder}")
        self._trim_space = len(decoder["decoders"]) == 4
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self._eos_token_ids = set(eos_token_ids or [])
        if self.eos_token_id is not None:
            self._eos_token_ids.add(self.eos_token_id)

    # --- what generation uses, from the backend -------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        """transformers' `encode`; `split_special_tokens`: special tokens' text is plain text."""
        if split_special_tokens:
            return self._plain_backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def _plain_backend(self):
        """A backend that reads special tokens' text as text: its own copy, as the flag is
        the tokenizer's state and the backend is shared with the generation thread."""
        if isinstance(self._backend, tokenizer_index.TokenizerIndex):
            return tokenizer_index.TokenizerIndex(self._path, encode_special_tokens=True)
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def convert_tokens_to_ids(self, token: str) -> int | None:
        found = self._backend.token_to_id(token)
        return self.unk_token_id if found is None else found

    def _special(self, role: str):
        token = self._config.get(f"{role}_token")
        return token.get("content") if isinstance(token, dict) else token

    def _special_id(self, role: str) -> int | None:
        token = self._special(role)
        return None if token is None else self._backend.token_to_id(token)

    bos_token = property(lambda self: self._special("bos"))
    eos_token = property(lambda self: self._special("eos"))
    unk_token = property(lambda self: self._special("unk"))
    pad_token = property(lambda self: self._special("pad"))
    bos_token_id = property(lambda self: self._special_id("bos"))
    eos_token_id = property(lambda self: self._special_id("eos"))
    unk_token_id = property(lambda self: self._special_id("unk"))
    pad_token_id = property(lambda self: self._special_id("pad"))

    @property
    def chat_template(self):
        return self._full.chat_template if self._full is not None else self._config.get("chat_template")

    @property
    def has_chat_template(self) -> bool:
        return self._full.has_chat_template if self._full is not None else self.chat_template is not None

    @has_chat_template.setter
    def has_chat_template(self, value: bool):
        self.full.has_chat_template = value

    @property
    def eos_token_ids(self) -> set:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, value):
        self._eos_token_ids = set(value) if value is not None else set()
        if self._full is not None:
            self._full.eos_token_ids = self._eos_token_ids

    def add_eos_token(self, token: str):
        try:
            token_id = int(token)
        except ValueError:
            token_id = self.convert_tokens_to_ids(token)
        if token_id is None:
            raise ValueError(f"'{token}' is not a token for this tokenizer")
        self._eos_token_ids.add(token_id)

    @property
    def detokenizer(self):
        """A fresh streaming detokenizer (mlx-lm's SPMStreamingDetokenizer behaviour)."""
        return _SPMDetokenizer(self._backend, self._trim_space)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    # --- everything else: mlx-lm's own wrapper, loaded once on first use -------------------

    @property
    def full(self):
        """mlx-lm's `TokenizerWrapper` for the same folder (imports transformers: seconds);
        waits for a load `load_full_in_background` started."""
        if self._full is None:
            with self._full_lock:
                if self._full is None:
                    from mlx_lm.utils import load_tokenizer

                    extra = None if self._template_override is None else {"chat_template": self._template_override}
                    full = load_tokenizer(self._path, tokenizer_config_extra=extra)
                    full.eos_token_ids = self._eos_token_ids
                    self._full = full
        return self._full

    def load_full_in_background(self) -> None:
        """Start loading `full` on a daemon thread, for a caller that needs it only after
        waiting on something else (a chat's first message is typed): ~5 s of a chat's
        start on a 2-core CPU. An error there is raised again by the first use of `full`."""
        def load():
            try:
                self.full
            except Exception:  # noqa: BLE001  (the next use of `full` tries again and raises it)
                pass

        if self._full is None:
            threading.Thread(target=load, name="mlx-lm tokenizer", daemon=True).start()

    @property
    def _tokenizer(self):
        return self.full._tokenizer

    def __getattr__(self, name):  # only for names this class does not define
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.full, name)


def token_bytes_reader(tokenizer):
    """id -> (the bytes the tokenizer's streaming detokenizer adds to the text for it, its
    kind), so log-probs can show each token as the answer's text holds it (OpenAI's `bytes`).
    Kinds: "piece", a vocabulary entry; "byte", a SentencePiece byte-fallback token
    (`<0xE2>`: one byte, where decoding the token alone gives U+FFFD); "missing", an id past
    the tokenizer's vocabulary (checkpoints pad their embedding), shown as mlx-lm's
    byte-level detokenizer shows it ("!") and as nothing by the others, which cannot add it."""
    kind = type(tokenizer.detokenizer).__name__  # mlx-lm's choice, made from the decoder

    def piece(token: int) -> str | None:
        try:
            return tokenizer.convert_ids_to_tokens([token])[0]
        except (IndexError, OverflowError, TypeError):
            return None

    if "SPM" in kind:  # mlx-lm's SPMStreamingDetokenizer, our _SPMDetokenizer
        def read(token: int) -> tuple[bytes, str]:
            text = piece(token)
            if text is None:
                return b"", "missing"
            return _piece_bytes(text).replace(_SPMDetokenizer._sep, b" "), "byte" if _is_byte_piece(text) else "piece"
    elif "BPE" in kind:  # GPT-2's byte-level alphabet: one character per byte
        alphabet = _byte_level_alphabet()

        def read(token: int) -> tuple[bytes, str]:
            text = piece(token)
            if text is None:
                return b"!", "missing"  # mlx-lm's BPEStreamingDetokenizer's stand-in
            # As that detokenizer joins them: a character outside the alphabet (an added
            # token's) as its UTF-8, and byte 0's "Ā" too (it tests the byte for truth).
            return b"".join(bytes([alphabet[c]]) if alphabet.get(c) else c.encode("utf-8") for c in text), "piece"
    else:
        def read(token: int) -> tuple[bytes, str]:
            try:
                return tokenizer.decode([token]).encode("utf-8"), "piece"
            except Exception:  # noqa: BLE001  (an id the tokenizer lacks)
                return b"", "missing"
    return read


def trims_first_space(tokenizer) -> bool:
    """Whether the tokenizer's streaming detokenizer drops a space the text starts with:
    mlx-lm's byte-level one always does, SentencePiece ones where the decoder strips it."""
    detokenizer = tokenizer.detokenizer
    return bool(getattr(detokenizer, "trim_space", "BPE" in type(detokenizer).__name__))


def _is_byte_piece(piece: str) -> bool:
    """A SentencePiece byte-fallback piece (`<0x00>` .. `<0xFF>`), by mlx-lm's rule."""
    return piece.startswith("<0x")


def _piece_bytes(piece: str) -> bytes:
    """A SentencePiece piece's bytes, `▁` kept: byte tokens carry their value in hex."""
    return bytes([int(piece[3:5], 16)]) if _is_byte_piece(piece) else piece.encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable bytes stand for themselves, the
    rest for characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


class _SPMDetokenizer:
    """mlx-lm's `SPMStreamingDetokenizer`, reading each token's bytes from the backend when
    it arrives instead of building a 262k-entry table first (~0.4 s)."""

    _sep = "\u2581".encode("utf-8")

    def __init__(self, backend, trim_space: bool):
        self._backend, self.trim_space = backend, trim_space
        self._bytes: dict[int, bytes] = {}
        self.reset()

    def reset(self):
        self.offset = 0
        self._unflushed = b""
        self.text = ""
        self.tokens = []

    def _token_bytes(self, token: int) -> bytes:
        value = self._bytes.get(token)
        if value is None:
            text = self._backend.id_to_token(token)
            if text is None:
                raise IndexError(f"token id {token} is outside the vocabulary")
            value = self._bytes[token] = _piece_bytes(text)
        return value

    def _try_flush(self, force=False):
        text = self._unflushed.replace(self._sep, b" ").decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return
        if not self.text and self.trim_space and text and text[0] == " ":
            text = text[1:]
        self.text += text
        self._unflushed = b""

    def add_token(self, token):
        self.tokens.append(token)
        self._unflushed += self._token_bytes(token)
        self._try_flush()

    def finalize(self):
        self._try_flush(force=True)
        self._unflushed = b""

    @property
    def last_segment(self):
        """The readable text added since this property was last read."""
        text = self.text
        segment = text[self.offset:]
        self.offset = len(text)
        return segment
