"""Images in chat requests. Both APIs' routes turn an image in a user message (OpenAI's
`image_url` part, Anthropic's `image` block) into a template part carrying its source,
`{"type": "image", "url", "where", "kind"}` (where: its path in the request; kind: the
part's type there); `take_images` reads them (data URLs; local files only with
`serve --allow-image-files`, http(s) only with `--allow-image-urls`) for the model's processor and leaves
`{"type": "image"}`, which the chat template renders as the model's image placeholder."""

from __future__ import annotations

from typing import Optional

from mlx_spec.models.vision import ImageError, ImagePrompter, image_from_url
from mlx_spec.server.api_error import ApiError


def content_texts(content) -> list[str]:
    """The text of a template message's content: a string, or a part list's text parts."""
    if isinstance(content, str):
        return [content]
    return [part["text"] for part in content or () if part.get("type") == "text"]


def take_images(messages: list[dict], prompter: Optional[ImagePrompter],
                allow_remote: bool, allow_files: bool = False) -> tuple[list[dict], list]:
    """(the messages with each image part's source read, the images in order as PIL
    images); a model without a vision tower, or an image that cannot be read, is a 400."""
    out, images = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(part.get("type") == "image" for part in content):
            parts = []
            for part in content:
                if part.get("type") != "image":
                    parts.append(part)
                    continue
                if prompter is None:
                    raise ApiError(400, f"{part['where']}: {part['kind']} content needs a model with a vision "
                                        "tower; this one takes text only", param=part["where"],
                                   code="unsupported_content")
                try:
                    images.append(image_from_url(part["url"], part["where"], allow_remote, allow_files))
                except ImageError as error:
                    raise ApiError(400, str(error), param=part["where"]) from None
                parts.append({"type": "image"})
            message = {**message, "content": parts}
        out.append(message)
    return out, images
