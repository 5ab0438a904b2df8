"""What every family's image side (qwen3_5.py, gemma4.py) builds on: its
error, its tower's tensors read from the checkpoint, and the splice of the
tower's output into the text's input embeddings."""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

import mlx.core as mx

from specgate.engines.base import ImageInput


class VisionError(ValueError):
    """A model that cannot take images, or an image it cannot take."""


def tensors(path: str, prefixes: Sequence[str]) -> dict[str, mx.array]:
    """The checkpoint's tensors under any of `prefixes`, the prefix cut."""
    out = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        for name, value in mx.load(file).items():
            for p in prefixes:
                if name.startswith(p):
                    out[name[len(p):]] = value
    return out


def splice(text: mx.array, features: mx.array, start: int, images: Sequence[ImageInput]) -> mx.array:
    """Input embeddings (1, L, H) of a segment starting at prompt position
    `start`: the text's, each image's tokens replaced by its rows of
    `features` (the images' rows in order)."""
    pieces, at, used = [], 0, 0
    for image in images:
        a = image.start - start
        pieces += [text[0, at:a], features[used : used + image.length]]
        at, used = a + image.length, used + image.length
    pieces.append(text[0, at:])
    return mx.concatenate(pieces)[None]
