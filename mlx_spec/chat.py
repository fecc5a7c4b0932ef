"""Multi-turn chat over one engine: the conversation's token ids and both models' caches
carry from turn to turn, so each turn prefills only its new tokens."""

from __future__ import annotations

from typing import Iterator, Optional

from mlx_spec.engine import Engine
from mlx_spec.stream import Response, stream_generate


class ChatSession:
    """A conversation with the chat template applied.

    Each turn's prompt is the cached conversation ids plus the tokens of the template text
    that follows them, so earlier tokens are never re-tokenized (re-encoding generated text
    can give different ids). If the template re-renders history differently, the whole
    prompt is tokenized again and the caches keep their longest common prefix.
    """

    def __init__(self, engine: Engine, tokenizer, system: Optional[str] = None,
                 template_kwargs: Optional[dict] = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.system = system
        self.template_kwargs = template_kwargs or {}  # e.g. enable_thinking
        self.prompt_ids: list[int] = []  # the latest turn's prompt
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.cache = self.engine.make_prompt_cache()
        self.ids: list[int] = []  # prompt + generated ids of the conversation so far
        self.rendered = ""  # the template's text for exactly those ids

    def save(self, path, key: dict) -> int:
        """Write the conversation (messages and ids) and both caches to `path` atomically
        (`cache_files.save_prompt_cache`; `key` is `cache_files.cache_key`'s). Raises
        OSError when the write fails; returns the bytes written."""
        from mlx_spec.cache_files import save_prompt_cache

        return save_prompt_cache(path, self.cache, key, extra={
            "messages": self.messages, "ids": self.ids, "rendered": self.rendered,
            "system": self.system})

    def resume(self, path, key: dict) -> None:
        """Continue the conversation saved at `path`: its messages, ids and caches, so the
        next turn prefills only its own tokens. Raises `cache_files.CacheFileError` (one
        line) for a file that does not fit this engine and tokenizer."""
        from mlx_spec.cache_files import CacheFileError, load_prompt_cache

        cache, extra = load_prompt_cache(path, self.engine, key)
        try:
            messages, ids, rendered = extra["messages"], extra["ids"], extra["rendered"]
            if not (isinstance(messages, list) and isinstance(ids, list) and isinstance(rendered, str)):
                raise TypeError
        except (KeyError, TypeError):
            raise CacheFileError(f"{path} holds caches but no chat session") from None
        self.messages, self.ids, self.rendered, self.cache = messages, ids, rendered, cache
        self.system = extra.get("system")

    def _prompt_ids(self, messages: list[dict]) -> tuple[list[int], str]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        if self.ids and text.startswith(self.rendered):
            suffix = text[len(self.rendered) :]
            return self.ids + list(self.tokenizer.encode(suffix, add_special_tokens=False)), text
        return list(self.tokenizer.encode(text, add_special_tokens=False)), text

    def ask(self, content: str, params, **kwargs) -> Iterator[Response]:
        """Stream the assistant's answer to `content`; keyword arguments as
        `stream_generate` (gamma, max_tokens, stop, stats). Closing the generator early
        (Ctrl-C) keeps the partial answer and leaves the caches consistent."""
        messages = self.messages + [{"role": "user", "content": content}]
        prompt_ids, text = self._prompt_ids(messages)
        self.prompt_ids = prompt_ids
        shown: list[str] = []
        generated: list[int] = []
        try:
            for response in stream_generate(
                self.engine, self.tokenizer, prompt_ids, params, prompt_cache=self.cache, **kwargs
            ):
                shown.append(response.text)
                generated += response.tokens
                yield response
        finally:
            self._remember(messages, prompt_ids, text, "".join(shown), generated)

    def _remember(self, messages, prompt_ids, text, reply, generated) -> None:
        """Keep the turn as the user saw it: the answer text shown (cut before a stop
        string) and the ids behind it. A stop string may begin inside a token; the shown
        part of that token is encoded on its own."""
        said = self.tokenizer.decode([t for t in generated if t not in self.engine.eos_ids])
        self.messages = messages + [{"role": "assistant", "content": reply}]
        if reply != said and not reply.startswith(said):
            # The ids do not spell what was shown: let the next turn tokenize afresh (the
            # caches still keep their longest common prefix).
            self.ids, self.rendered = [], ""
            return
        generated = generated + list(self.tokenizer.encode(reply[len(said):], add_special_tokens=False))
        self.ids = prompt_ids + generated
        # The template's text for exactly those ids, so the next turn's template text starts
        # with it whenever the template renders history faithfully.
        self.rendered = text + self.tokenizer.decode(generated, skip_special_tokens=False)
