"""Images into the target's prefill, through mlx-vlm's vision towers and processors.

The target stays the mlx-lm language model it always is; for a checkpoint with a vision
tower (Gemma 3 4B and up, Gemma 4) `load_vision` adds mlx-vlm's model of the same folder
with its language model swapped for the target's (one copy of the weights), and its
processor. `ImagePrompter.prompt` expands each image placeholder the chat template wrote into the
processor's image sequence: Gemma 3's `<start_of_image>` into a fixed one, Gemma 4's
`<|image|>` into `<|image>`, one `<|image|>` per soft token (how many, the processor sets
from the image's size) and `<image|>`. The prefill then runs on input embeddings with the
image features at the image tokens (Gemma 3: mlx-vlm's `get_input_embeddings`; Gemma 4:
mlx-vlm's vision tower and embedder, its per-layer inputs from the ids with image tokens
as <pad>, as mlx-vlm and transformers compute them). A Gemma 4 checkpoint whose text config
says `use_bidirectional_attention: "vision"` (12B and up) lets an image's tokens see each
other both ways in the prefill on its sliding-window layers (`image_blocks`, read by
`cache.WindowKVCache`), as transformers and Google's reference do. After the prefill the
rounds run on token ids as always: a drafter that reads the target's states (MTP) drafts as
before, n-gram lookup drafts from the ids, and a text-only draft model sees only the
placeholder ids, so it stays exact with lower acceptance.

A cache holds `ImagePrompt.keys`, the ids with each image token marked by its image's
content hash, so prefix reuse never mistakes one image for another with the same
placeholder ids.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from mlx_spec.errors import ModelLoadError, UsageError

MAX_IMAGE_BYTES = 20 * 2**20  # an encoded image (OpenAI's limit per image)
MAX_IMAGE_PIXELS = 50_000_000  # decoded width x height: a small file can decode huge
INSTALL_HINT = "pip install 'mlx-spec[vision]'"


class ImageError(UsageError):
    """An image that cannot be read: too big, not an image, not allowed to be fetched."""


@dataclass
class ImagePrompt:
    """A prompt with images, ready for the prefill (`Engine.rounds(images=...)`).

    Attributes:
        ids: the prompt's ids, each image placeholder expanded to the processor's sequence.
        keys: `ids` with each image token as (id, its image's sha256): what caches compare.
        pixel_values: the processor's pixel values, one [3, H, W] array per image (Gemma 4's
            sizes differ by image), or None.
    """

    ids: list[int]
    keys: list
    pixel_values: Optional[list]

    def extended(self, ids: list[int]) -> "ImagePrompt":
        """The same images for `ids`, which continue this prompt's ids (generated text)."""
        return ImagePrompt(ids, self.keys + ids[len(self.ids):], self.pixel_values)

    def then(self, more: "ImagePrompt") -> "ImagePrompt":
        """This prompt followed by `more` (a conversation's next turn, with its images)."""
        return ImagePrompt(self.ids + more.ids, self.keys + more.keys,
                           [*(self.pixel_values or ()), *(more.pixel_values or ())])


class ImagePrompter:
    """A checkpoint's processor (mlx-vlm's): images and a rendered prompt into an
    `ImagePrompt`. Needs no weights, so a server keeps it while the models are unloaded."""

    def __init__(self, processor):
        self.processor = processor
        tokenizer = processor.tokenizer
        # Gemma 4's image processor sizes each image's soft tokens (`max_soft_tokens`);
        # its template writes the image token itself as the placeholder.
        self.sized = hasattr(processor.image_processor, "max_soft_tokens")
        self.placeholder = processor.image_token if self.sized else processor.boi_token
        self.placeholder_id = tokenizer.convert_tokens_to_ids(self.placeholder)
        self.image_id = processor.image_token_id
        if self.sized:
            self.boi_id, self.eoi_id = map(tokenizer.convert_tokens_to_ids, (processor.boi_token, processor.eoi_token))
        else:
            self.sequence = tokenizer.encode(processor.full_image_sequence, add_special_tokens=False)

    def _process(self, images: list) -> tuple[list, list[list[int]]]:
        """(one pixel array per image, each image's token sequence)."""
        if self.sized:
            data, soft_tokens = self.processor.image_processor(images)
            return list(data["pixel_values"]), [[self.boi_id, *[self.image_id] * n, self.eoi_id] for n in soft_tokens]
        # One crop per image: pan-and-scan's extra crops would each need their own sequence.
        pixels = self.processor.image_processor(images, return_tensors="np", do_pan_and_scan=False)["pixel_values"]
        return list(pixels), [self.sequence] * len(images)

    def prompt(self, ids: list[int], images: list) -> ImagePrompt:
        """`ids` (a rendered prompt, one placeholder per image) with `images` (PIL images,
        in order) as an `ImagePrompt`; a count that does not match is refused."""
        import numpy as np  # not at import: the CLI starts without numpy

        at = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(at) != len(images):
            raise ImageError(f"the prompt has {len(at)} image placeholder(s) for {len(images)} image(s)")
        pixels, sequences = self._process(images) if images else ([], [])
        expanded, keys = [], []
        for n, (begin, end) in enumerate(zip([-1, *at], [*at, len(ids)])):
            if n:  # the n-th placeholder: its image's sequence
                image = np.ascontiguousarray(pixels[n - 1])
                digest = hashlib.sha256(str(image.shape).encode() + image.tobytes()).hexdigest()
                expanded += sequences[n - 1]
                keys += [(t, digest) if t == self.image_id else t for t in sequences[n - 1]]
            expanded += ids[begin + 1:end]
            keys += ids[begin + 1:end]
        return ImagePrompt(expanded, keys, pixels)


class Vision:
    """A target's vision tower (mlx-vlm's model, its language model the target's own) and
    its checkpoint's `ImagePrompter`.

    `bidirectional`: an image's tokens attend to each other both ways in the prefill
    (Gemma 4 with `use_bidirectional_attention: "vision"`)."""

    def __init__(self, vlm, prompter: ImagePrompter, bidirectional: bool = False):
        self.vlm = vlm
        self.prompter = prompter
        self.bidirectional = bidirectional

    def embed(self, images: ImagePrompt, begin: int = 0, end: Optional[int] = None) -> dict:
        """The inputs the target's forward takes for the whole prompt, by row: input
        embeddings [1, L, H] with the images' features at the image tokens (Gemma 4: also
        its per-layer inputs, and `image_blocks`, each row's image or -1, when images are
        bidirectional); {} when rows begin..end hold no image token (a later turn's text:
        no vision tower to run)."""
        image_id = self.prompter.image_id
        if image_id not in images.ids[begin:end]:
            return {}
        tokens = mx.array(images.ids)[None]
        image_rows = tokens == image_id
        text_model = self.vlm.language_model.model
        # Text rows as a decode step embeds them (mlx-vlm's Gemma 3 zeroes <pad> rows, so a
        # generated id 0 would read differently once re-prefilled).
        text = text_model.embed_tokens(tokens)
        pixels = [mx.array(p) for p in images.pixel_values]
        if not self.prompter.sized:
            features = self.vlm.get_input_embeddings(tokens, pixel_values=mx.stack(pixels),
                                                     mask=mx.ones(tokens.shape, mx.int32)).inputs_embeds
            return {"input_embeddings": mx.where(image_rows[..., None], features, text)}
        from mlx_vlm.models.gemma4.gemma4 import masked_scatter

        features = self.vlm.encode_image([p[None] for p in pixels]).astype(text.dtype)  # [1, image tokens, H]
        # mlx-lm's Gemma 4 scales its input embeddings by embed_scale; mlx-vlm's features are final.
        placed = masked_scatter(text, mx.broadcast_to(image_rows[..., None], text.shape),
                                features / text_model.embed_scale)
        inputs = {"input_embeddings": placed}
        if text_model.hidden_size_per_layer_input:  # per-layer inputs read image tokens as <pad> (0)
            inputs["per_layer_inputs"] = text_model._get_per_layer_inputs(mx.where(image_rows, 0, tokens))
        if self.bidirectional:
            starts = image_rows & ~mx.concatenate([mx.zeros((1, 1), mx.bool_), image_rows[:, :-1]], axis=1)
            inputs["image_blocks"] = mx.where(image_rows, mx.cumsum(starts.astype(mx.int32), axis=1) - 1, -1)
        return inputs


def load_vision(path: Path, config: dict, target) -> Optional[Vision]:
    """The vision tower and processor of the checkpoint in `path` (whose config.json is
    `config`), joined to the loaded `target`; None for a model without one."""
    if "vision_config" not in config:
        return None
    if config.get("model_type") not in ("gemma3", "gemma4"):  # the ones wired to our prefill (docs/images.md)
        warnings.warn(f"images on {config.get('model_type')} checkpoints are not supported yet: "
                      "loading the language model only", stacklevel=3)
        return None
    try:
        from mlx_vlm.utils import load_model, load_processor
    except ImportError:
        raise ModelLoadError(f"{path} has a vision tower, which needs mlx-vlm: {INSTALL_HINT}") from None
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # mlx-vlm asks for use_fast=False, which transformers 5 warns about
    try:
        vlm = load_model(path, lazy=True)
        with warnings.catch_warnings():  # mlx-vlm's Gemma 4 processor builds an audio feature
            # extractor whose default mel filters transformers warns about; images never use it
            warnings.filterwarnings("ignore", "At least one mel filter has all zero values")
            processor = load_processor(path, add_detokenizer=False)
    except (ValueError, KeyError, OSError, RuntimeError, AttributeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelLoadError(f"cannot load the vision tower in {path}: {reason}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # One copy of the language model: the target's (its embeddings are what images join).
    vlm.language_model = target.language_model
    if getattr(vlm, "audio_tower", None) is not None:  # Gemma 4 E2B/E4B: images only, so its
        vlm.audio_tower = vlm.embed_audio = None  # (lazy) audio weights are never read
    dtype = target.language_model.model.embed_tokens.weight.dtype
    for name, module in vlm.children().items():
        if name != "language_model" and module is not None:
            module.set_dtype(dtype)
            mx.eval(module.parameters())
    bidirectional = config.get("text_config", {}).get("use_bidirectional_attention") == "vision"
    return Vision(vlm, ImagePrompter(processor), bidirectional)


def open_image(data: bytes, where: str):
    """`data` as an RGB PIL image, or an `ImageError` naming `where` and the limit broken."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{where}: the image is {len(data):,} bytes, over the limit of {MAX_IMAGE_BYTES:,}")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ImageError(f"{where}: the image is {image.width}x{image.height} pixels, over the limit of "
                             f"{MAX_IMAGE_PIXELS:,} pixels")
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        if isinstance(error, ImageError):
            raise
        raise ImageError(f"{where}: not an image PIL can read") from None


def read_image_file(path: str, where: str):
    """An image file as a PIL image (`open_image`)."""
    file = Path(path).expanduser()
    where = f"{where} {path}"
    if not file.is_file():
        raise ImageError(f"{where}: no such file")
    if file.stat().st_size > MAX_IMAGE_BYTES:
        raise ImageError(f"{where}: the file is {file.stat().st_size:,} bytes, over the limit of {MAX_IMAGE_BYTES:,}")
    return open_image(file.read_bytes(), where)


def decode_base64_image(data: str, where: str):
    """A base64 image (`open_image`); malformed base64 is refused in one line."""
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"{where}: the image is over the limit of {MAX_IMAGE_BYTES:,} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the image data is not valid base64") from None
    return open_image(raw, where)


def image_from_url(url: str, where: str, allow_remote: bool = False, allow_files: bool = True):
    """An image from a data: URL, (when `allow_files`) a file: URL or local path, or (when
    `allow_remote`, i.e. `serve --allow-image-urls`) an http(s) URL; anything else is refused
    in one line. A server reads local files only with `serve --allow-image-files`: whoever
    may call it could otherwise probe the server's disk (a missing file and a file that is
    no image answer differently)."""
    import urllib.request  # ~20 ms of imports, for requests with image URLs only

    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        head, comma, data = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise ImageError(f"{where}: a data URL must be data:<media type>;base64,<data>")
        return decode_base64_image(data, where)
    if scheme == "file" or not scheme or len(scheme) == 1:  # C:\\... is a path, not a scheme
        if not allow_files:
            raise ImageError(f"{where}: local image files are not read unless the server is started "
                             "with --allow-image-files; send the image as a data: URL or base64")
    if scheme == "file":
        return read_image_file(urllib.request.url2pathname(urllib.parse.urlsplit(url).path), where)
    if scheme in ("http", "https"):
        if not allow_remote:
            raise ImageError(f"{where}: image URLs are not fetched unless the server is started with "
                             "--allow-image-urls")
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                data = response.read(MAX_IMAGE_BYTES + 1)
        except OSError as error:
            raise ImageError(f"{where}: cannot fetch {url}: {error}") from None
        return open_image(data, where)
    if scheme and len(scheme) > 1:  # C:\... is a path, not a scheme
        raise ImageError(f"{where}: image URLs with scheme '{scheme}' are not read")
    return read_image_file(url, where)
