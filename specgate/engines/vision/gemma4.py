"""Gemma-4's image side: its image processor, tower (patches pooled 3x3 into
soft tokens) and projection into the text width from mlx-vlm; the template
writes one image token an image, which grows to <boi>, the image's soft
tokens, <eoi>.

Two things differ from text in the image segment's forward, both as
mlx-vlm's own Gemma-4 does them:
- mlx-lm's text model scales its input embeddings by sqrt(hidden_size);
  the tower's output is not scaled, so it goes in divided by that, and its
  tokens' per-layer inputs (the small models') are those of the pad id;
- where the checkpoint says `use_bidirectional_attention: "vision"` (the
  releases do), an image's tokens attend to each other both ways, in full
  and sliding layers alike. `install` gives *this* model instance's text
  model a `_make_masks` that adds those blocks inside `image_blocks(...)`
  and is mlx-lm's own elsewhere.
"""

from __future__ import annotations

import json
import os
import threading
import types
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_causal_mask

from specgate.engines.base import ImageInput
from specgate.engines.vision.family import VisionError, expand, segment, splice, tensors


def processor_settings(path: str) -> dict:
    """The image processor's settings: nested in processor_config.json as
    the releases ship them, or flat in preprocessor_config.json."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                raw = json.load(f)
            raw = raw.get("image_processor", raw)
            keep = ("patch_size", "max_soft_tokens", "pooling_kernel_size", "do_resize", "do_rescale",
                    "do_normalize", "rescale_factor", "image_mean", "image_std")  # fmt: skip
            return {k: raw[k] for k in keep if k in raw}
    return {}


_local = threading.local()


@contextmanager
def image_blocks(blocks: np.ndarray | None):
    """Forwards on this thread let the new tokens of each block attend to
    each other both ways: blocks (L,), a block id per token, -1 for text."""
    prev, _local.blocks = getattr(_local, "blocks", None), blocks
    try:
        yield
    finally:
        _local.blocks = prev


def _masks_with_blocks(self, h, cache):
    blocks = getattr(_local, "blocks", None)
    if blocks is None or h.shape[1] == 1:
        return self._specgate_masks(h, cache)
    n = h.shape[1]
    b = mx.array(blocks)
    same = (b[:, None] == b[None, :]) & (b[:, None] >= 0)  # (n, n)
    made, masks = {}, []
    for layer, c in zip(self.layers, cache, strict=False):
        kind = layer.layer_type
        if kind not in made:
            window = self.window_size if kind == "sliding_attention" else None
            base = (c.make_mask(n, return_array=True, window_size=window) if c is not None
                    else create_causal_mask(n, window_size=window))  # fmt: skip
            # The new tokens are the last n keys (a multi-token update appends them).
            extra = mx.concatenate([mx.zeros((n, base.shape[-1] - n), dtype=mx.bool_), same], axis=1)
            made[kind] = base | extra
        masks.append(made[kind])
    return masks


def install(model: nn.Module) -> None:
    text = (model.language_model if hasattr(model, "language_model") else model).model
    if getattr(text, "_specgate_masks", None) is None:
        text._specgate_masks = text._make_masks
        text._make_masks = types.MethodType(_masks_with_blocks, text)


class GemmaVision:
    """Gemma-4's image side (module docstring)."""

    def __init__(self, path: str, config: dict, model: nn.Module):
        from mlx_vlm.models.gemma4.config import VisionConfig
        from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
        from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor
        from mlx_vlm.models.gemma4.vision import VisionModel

        vc = VisionConfig.from_dict(config["vision_config"])
        text = config["text_config"]
        self.tower = VisionModel(vc)
        weights = self.tower.sanitize(tensors(path, ("model.vision_tower.", "vision_tower.")))
        projection = tensors(path, ("model.embed_vision.", "embed_vision."))
        if not weights or not projection:
            raise VisionError("its checkpoint has no vision tower tensors (model.vision_tower.*, "
                              "model.embed_vision.*)")  # fmt: skip
        if not vc.use_clipped_linears:  # (the clipping bounds are stored all the same)
            weights = {k: v for k, v in weights.items()
                       if not k.endswith(("input_max", "input_min", "output_max", "output_min"))}  # fmt: skip
        self.tower.load_weights(list(weights.items()))
        self.project = MultimodalEmbedder(vc.hidden_size, text["hidden_size"], eps=vc.rms_norm_eps)
        self.project.load_weights(list(projection.items()))
        mx.eval(self.tower.parameters(), self.project.parameters())
        self.processor = Gemma4ImageProcessor(**processor_settings(path))
        self.image_token_id = int(config["image_token_id"])
        self.boi_id, self.eoi_id = int(config["boi_token_id"]), int(config["eoi_token_id"])
        self.pad_id = int(text.get("pad_token_id", config.get("pad_token_id", 0)) or 0)
        self.embed_scale = text["hidden_size"] ** 0.5
        self.bidirectional = text.get("use_bidirectional_attention") == "vision"
        if self.bidirectional:
            install(model)

    # -- the gateway's side (CPU workers) ---------------------------------------

    def modules(self) -> list[nn.Module]:
        return [self.tower, self.project]

    def preprocess(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int], int]:
        """An RGB image (H, W, 3) uint8 -> (pixels (C, H', W'), grid, tokens)."""
        data, soft = self.processor.preprocess([image])
        pixels = np.asarray(data["pixel_values"][0], dtype=np.float32)
        p = self.processor.patch_size
        return pixels, (1, pixels.shape[1] // p, pixels.shape[2] // p), int(soft[0])

    def tokens_for(self, height: int, width: int) -> int:
        from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

        proc = self.processor
        pool, p = proc.pooling_kernel_size, proc.patch_size
        h, w = get_aspect_ratio_preserving_size(height, width, p, proc.max_soft_tokens * pool**2, pool)
        return (h // p) * (w // p) // pool**2

    def expand(self, prompt: Sequence[int], sizes: Sequence[int]) -> tuple[list[int], list[int]]:
        """The prompt with its i-th image token grown to <boi>, sizes[i] soft
        tokens, <eoi>; and where each image's soft tokens start."""
        return expand(prompt, sizes, self.image_token_id, [self.boi_id], [self.eoi_id])

    # -- the engine's side (its thread, under the model's lock) ---------------

    def embeddings(self, embed, tokens: Sequence[int], start: int,
                   inside: Sequence[ImageInput]) -> mx.array:  # fmt: skip
        """Input embeddings (1, L, H) of prompt[start:start + L] = `tokens`
        with its images (`inside`), as mlx-lm's text model takes them
        (before its sqrt(hidden) scale)."""
        text = embed(mx.array([list(tokens)]))
        if not inside:
            return text
        dtype = self.tower.patch_embedder.input_proj.weight.dtype
        features = mx.concatenate([self.tower(mx.array(i.pixels)[None].astype(dtype))[0]
                                   for i in inside])  # fmt: skip
        features = self.project(features) / self.embed_scale
        return splice(text, features.astype(text.dtype), start, inside)

    def prefill(self, run, cache: list, embed, prompt: Sequence[int], start: int, end: int,
                images: Sequence[ImageInput]) -> Any:  # fmt: skip
        """Feed prompt[start:end] (its images whole) into `cache` through
        `run(tokens (1, L), embeddings (1, L, H))`; its result is returned."""
        tokens, inside = segment(prompt, start, end, images)
        emb = self.embeddings(embed, tokens, start, inside)
        # The ids go in for the per-layer inputs only: an image's are the pad's.
        ids = list(tokens)
        blocks = np.full(len(tokens), -1, dtype=np.int32)
        for n, image in enumerate(inside):
            a = image.start - start
            ids[a : a + image.length] = [self.pad_id] * image.length
            blocks[a : a + image.length] = n
        with image_blocks(blocks if self.bidirectional else None):
            return run(mx.array([ids]), emb)
