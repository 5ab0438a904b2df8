"""An image as a client sent it -> what its model's tower takes.

Run by the gateway's CPU workers, never the event loop: decoding and
resizing are CPU work. Every input is a stranger's: the bytes are bounded
by the body limit (or the URL fetch's), the format is one of those named,
and the pixel count is read from the header and checked before anything
is decoded, so a small file claiming a huge canvas (a decompression bomb)
is refused without allocating it. Pillow reads the files (a dependency of
mlx-vlm).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence

import numpy as np

from specgate.engines.base import ImageInput

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Larger images are resized down by the processor anyway (Qwen's to about
# 16M pixels at most); this bounds what is decoded on the way.
MAX_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image that cannot be read: said in the API's 400. `index`: which
    of the request's images."""

    index = 0


def _opened(data: bytes, max_pixels: int, then):
    """then(image) on the file opened lazily (its header read, no pixels),
    after the checks; every reading error an ImageError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            width, height = im.size
            if width * height > max_pixels:
                raise ImageError(f"{width}x{height} pixels: more than the {max_pixels} read here")
            if width < 1 or height < 1:
                raise ImageError("an image without pixels")
            return then(im)
    except UnidentifiedImageError:
        raise ImageError(f"not an image in a format read here ({', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt files
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"the image cannot be decoded: {e}") from None


def size(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(height, width), from the header alone."""
    return _opened(data, max_pixels, lambda im: (im.size[1], im.size[0]))


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """RGB pixels (H, W, 3) uint8 of an encoded image (its first frame)."""
    return _opened(data, max_pixels, lambda im: np.asarray(im.convert("RGB")))


class TooManyTokens(ImageError):
    """The images need more tokens than the context leaves."""


def prepare(vision, tokens: Sequence[int], images: Sequence[bytes],
            room: int) -> tuple[list[int], tuple[ImageInput, ...]]:  # fmt: skip
    """A rendered prompt (one image marker per image) and its images ->
    the prompt with each marker repeated per image token, and the images
    as the engines take them. `room`: the image tokens the context leaves,
    checked from the headers before any image is decoded (a large image's
    pixels and patches take hundreds of MB)."""
    need = 0
    for i, data in enumerate(images):
        try:
            need += vision.tokens_for(*size(data))
        except ImageError as e:
            e.index = i
            raise
    if need - len(images) > room:
        raise TooManyTokens(f"the images take {need} tokens, more than the {room + len(images)} "
                            "the model's context leaves")  # fmt: skip
    prepared = []
    for i, data in enumerate(images):
        try:
            pixels, grid, length = vision.preprocess(decode(data))
        except ImageError as e:
            e.index = i
            raise
        prepared.append((pixels, grid, length, hashlib.sha256(data).hexdigest()))
    expanded, starts = vision.expand(tokens, [p[2] for p in prepared])
    return expanded, tuple(ImageInput(start, grid, length, pixels, digest)
                           for start, (pixels, grid, length, digest) in zip(starts, prepared, strict=True))  # fmt: skip
