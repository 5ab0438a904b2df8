"""What every family's image side (qwen3_5.py, gemma4.py) builds on: its
error, its tower's tensors read from the checkpoint, growing the template's
image markers, checking an image segment, and the splice of the tower's
output into the text's input embeddings."""

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


def expand(prompt: Sequence[int], sizes: Sequence[int], marker: int, before: Sequence[int] = (),
           after: Sequence[int] = ()) -> tuple[list[int], list[int]]:  # fmt: skip
    """The prompt with its i-th `marker` grown to `before`, sizes[i] markers,
    `after`; and where each image's markers start."""
    out, starts, i = [], [], 0
    for t in prompt:
        if t != marker:
            out.append(t)
            continue
        if i >= len(sizes):
            raise VisionError("the prompt has more image markers than images")
        out += before
        starts.append(len(out))
        out += [t] * sizes[i] + list(after)
        i += 1
    if i != len(sizes):
        raise VisionError(f"the prompt's template placed {i} of {len(sizes)} images")
    return out, starts


def segment(prompt: Sequence[int], start: int, end: int,
            images: Sequence[ImageInput]) -> tuple[list[int], list[ImageInput]]:  # fmt: skip
    """prompt[start:end], an image segment, and its images; refused where it
    cuts an image or leaves no text after it to decode from."""
    if end >= len(prompt):
        raise VisionError("the prompt ends with an image: no text after it to decode from")
    if any(i.start < start < i.end or i.start < end < i.end for i in images):
        raise VisionError(f"a prefill segment [{start}, {end}) cuts an image")
    return list(prompt[start:end]), [i for i in images if start <= i.start and i.end <= end]
