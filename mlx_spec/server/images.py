"""Images in chat requests. Both APIs' routes turn an image in a user message (OpenAI's
`image_url` part, Anthropic's `image` block) into a template part carrying its source,
`{"type": "image", "url", "where", "kind"}` (where: its path in the request; kind: the
part's type there); `take_images` reads them (data URLs; local files only with
`serve --allow-image-files`, http(s) only with `--allow-image-urls`) for the model's processor and leaves
`{"type": "image"}`, which the chat template renders as the model's image placeholder."""

from __future__ import annotations

import time
import urllib.parse
from typing import Optional

from mlx_spec.models.vision import (
    FETCH_DEADLINE_S, MAX_IMAGE_URLS, MAX_IMAGES, MAX_REQUEST_PIXELS, ImageError, ImagePrompter, decode_image,
    image_from_url,
)
from mlx_spec.server.api_error import ApiError


def content_texts(content) -> list[str]:
    """The text of a template message's content: a string, or a part list's text parts."""
    if isinstance(content, str):
        return [content]
    return [part["text"] for part in content or () if part.get("type") == "text"]


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(part.get("type") == "image" for part in m["content"])
               for m in messages)


def take_images(messages: list[dict], prompter: Optional[ImagePrompter], allow_remote: bool,
                allow_files: bool = False, context_length: Optional[int] = None,
                allow_private: bool = False) -> tuple[list[dict], list]:
    """(the messages with each image part's source read, the images in order as PIL
    images); a model without a vision tower, or an image that cannot be read, is a 400.

    Before any image is decoded: at most `MAX_IMAGES` of them (`MAX_IMAGE_URLS` to fetch,
    all within `FETCH_DEADLINE_S` together, from public addresses unless `allow_private`),
    their least prompt tokens within `context_length`, and (from their headers) at most
    `MAX_REQUEST_PIXELS` in all; then each is decoded in turn. A few small files cannot
    make the server decode gigabytes, nor a slow image server hold it."""
    parts = [part for message in messages if isinstance(message.get("content"), list)
             for part in message["content"] if part.get("type") == "image"]
    if not parts:
        return messages, []
    if prompter is None:
        first = parts[0]
        raise ApiError(400, f"{first['where']}: {first['kind']} content needs a model with a vision "
                            "tower; this one takes text only", param=first["where"], code="unsupported_content")
    if len(parts) > MAX_IMAGES:
        raise ApiError(400, f"messages: {len(parts)} images, at most {MAX_IMAGES} per request",
                       param="messages", code="too_many_items")
    if context_length is not None and len(parts) * prompter.min_tokens >= context_length:
        raise ApiError(400, f"this model's context is {context_length} tokens, but {len(parts)} images alone "
                            f"need at least {len(parts) * prompter.min_tokens}", param="messages",
                       code="context_length_exceeded")
    remote = [p for p in parts if urllib.parse.urlsplit(p["url"]).scheme.lower() in ("http", "https")]
    if allow_remote and len(remote) > MAX_IMAGE_URLS:
        raise ApiError(400, f"messages: {len(remote)} image URLs, at most {MAX_IMAGE_URLS} per request",
                       param="messages", code="too_many_items")
    opened, pixels, deadline = [], 0, time.monotonic() + FETCH_DEADLINE_S
    for part in parts:
        try:
            image = image_from_url(part["url"], part["where"], allow_remote, allow_files, lazy=True,
                                   deadline=deadline, allow_private=allow_private)
        except ImageError as error:
            raise ApiError(400, str(error), param=part["where"]) from None
        pixels += image.width * image.height
        if pixels > MAX_REQUEST_PIXELS:
            raise ApiError(400, f"messages: the images hold over {MAX_REQUEST_PIXELS:,} pixels in all "
                                f"(the limit per request)", param="messages")
        opened.append(image)
    images = []
    for part, image in zip(parts, opened):
        try:
            images.append(decode_image(image, part["where"]))
        except ImageError as error:
            raise ApiError(400, str(error), param=part["where"]) from None
    out = [{**message, "content": [{"type": "image"} if part.get("type") == "image" else part
                                   for part in message["content"]]}
           if isinstance(message.get("content"), list) else message for message in messages]
    return out, images
