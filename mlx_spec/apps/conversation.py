"""Multi-turn chat over one engine: the conversation's token ids and both models' caches
carry from turn to turn, so each turn prefills only its new tokens."""

from __future__ import annotations

from typing import Iterator, Optional

from mlx_spec.apps.stream import Response, stream_generate
from mlx_spec.cache.files import CacheFileError, load_prompt_cache, save_prompt_cache
from mlx_spec.core.engine import Engine
from mlx_spec.errors import MlxSpecError
from mlx_spec.models.vision import ImagePrompt


class ChatSession:
    """A conversation with the chat template applied.

    Each turn's prompt is the cached conversation ids plus the tokens of the template text
    that follows them, so earlier tokens are never re-tokenized (re-encoding generated text
    can give different ids). If the template re-renders history differently, the whole
    prompt is tokenized again and the caches keep their longest common prefix.

    A turn may bring images (a target with a vision tower): they join the user's message as
    image parts, and the conversation's `ImagePrompt` (every image so far) goes with each
    turn's prompt, so the caches reuse image positions only for the same image.
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
        self.images: list = []  # the conversation's images, in order
        self.image_prompt = None  # an ImagePrompt for self.ids, once there are images

    def save(self, path, key: dict) -> int:
        """Write the conversation (messages and ids) and both caches to `path` atomically
        (`cache.files.save_prompt_cache`; `key` is `cache.files.cache_key`'s). Raises
        OSError when the write fails; returns the bytes written."""
        if self.images:  # the images themselves are not in the file, only their hashes
            raise MlxSpecError("a chat with images cannot be saved yet")
        return save_prompt_cache(path, self.cache, key, extra={
            "messages": self.messages, "ids": self.ids, "rendered": self.rendered,
            "system": self.system})

    def resume(self, path, key: dict) -> None:
        """Continue the conversation saved at `path`: its messages, ids and caches, so the
        next turn prefills only its own tokens. Raises `cache.files.CacheFileError` (one
        line) for a file that does not fit this engine and tokenizer."""
        cache, extra = load_prompt_cache(path, self.engine, key)
        try:
            messages, ids, rendered = extra["messages"], extra["ids"], extra["rendered"]
            if not (isinstance(messages, list) and isinstance(ids, list) and isinstance(rendered, str)):
                raise TypeError
        except (KeyError, TypeError):
            raise CacheFileError(f"{path} holds caches but no chat session") from None
        self.messages, self.ids, self.rendered, self.cache = messages, ids, rendered, cache
        self.system = extra.get("system")

    def _prompt_ids(self, messages: list[dict], images: list) -> tuple[list[int], str, Optional[ImagePrompt]]:
        """(prompt ids, the template's text, the `ImagePrompt` or None) for `messages`, whose
        last message brings `images`."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        prompter = self.engine.vision.prompter if images or self.images else None
        if self.ids and text.startswith(self.rendered):
            suffix = list(self.tokenizer.encode(text[len(self.rendered) :], add_special_tokens=False))
            if prompter is None:
                return self.ids + suffix, text, None
            # only the new text's placeholders expand: the held ids have their images' already
            held = self.image_prompt or ImagePrompt(self.ids, list(self.ids), None)
            prompt = held.then(prompter.prompt(suffix, images)) if images else held.extended(self.ids + suffix)
            return prompt.ids, text, prompt
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if prompter is None:
            return ids, text, None
        prompt = prompter.prompt(ids, self.images + images)
        return prompt.ids, text, prompt

    def ask(self, content: str, params, images: tuple = (), **kwargs) -> Iterator[Response]:
        """Stream the assistant's answer to `content` (after `images`, PIL images, for a
        target with a vision tower); keyword arguments as `stream_generate` (gamma,
        max_tokens, stop, stats). Closing the generator early (Ctrl-C) keeps the partial
        answer and leaves the caches consistent."""
        if images and self.engine.vision is None:
            raise MlxSpecError("the target model reads no images (it has no vision tower)")
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": content}]
        messages = self.messages + [{"role": "user", "content": parts if images else content}]
        prompt_ids, text, image_prompt = self._prompt_ids(messages, list(images))
        self.images += images
        self.prompt_ids = prompt_ids
        shown: list[str] = []
        generated: list[int] = []
        try:
            for response in stream_generate(
                self.engine, self.tokenizer, prompt_ids, params, prompt_cache=self.cache,
                images=image_prompt, **kwargs
            ):
                shown.append(response.text)
                generated += response.tokens
                yield response
        finally:
            self._remember(messages, prompt_ids, text, "".join(shown), generated, image_prompt)

    def _remember(self, messages, prompt_ids, text, reply, generated, image_prompt) -> None:
        """Keep the turn as the user saw it: the answer text shown (cut before a stop
        string) and the ids behind it. A stop string may begin inside a token; the shown
        part of that token is encoded on its own."""
        said = self.tokenizer.decode([t for t in generated if t not in self.engine.eos_ids])
        self.messages = messages + [{"role": "assistant", "content": reply}]
        if reply != said and not reply.startswith(said):
            # The ids do not spell what was shown: let the next turn tokenize afresh (the
            # caches still keep their longest common prefix).
            self.ids, self.rendered, self.image_prompt = [], "", None
            return
        generated = generated + list(self.tokenizer.encode(reply[len(said):], add_special_tokens=False))
        self.ids = prompt_ids + generated
        self.image_prompt = image_prompt.extended(self.ids) if image_prompt is not None else None
        # The template's text for exactly those ids, so the next turn's template text starts
        # with it whenever the template renders history faithfully.
        self.rendered = text + self.tokenizer.decode(generated, skip_special_tokens=False)
