"""Qwen3.5's (and 3.6's) image side: Qwen3-VL's numpy image processor and
ViT from mlx-vlm, the template's <|vision_start|><|image_pad|><|vision_end|>
with the pad repeated once per merged patch, and the text model's
multimodal positions (mrope.py) for the image segment's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from specgate.engines.base import ImageInput
from specgate.engines.vision import mrope
from specgate.engines.vision.family import VisionError, expand, segment, splice, tensors


class QwenVision:
    """Qwen3.5's image side: Qwen3-VL's processor and tower, M-RoPE positions."""

    def __init__(self, path: str, config: dict, model: nn.Module):
        from mlx_vlm.models.qwen3_5.config import VisionConfig
        from mlx_vlm.models.qwen3_5.vision import VisionModel
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (
            Qwen3VLImageProcessor,
            _qwen_vl_image_kwargs,
        )

        vc = VisionConfig.from_dict(config["vision_config"])
        self.tower = VisionModel(vc)
        weights = self.tower.sanitize(tensors(path, ("model.visual.", "visual.", "vision_tower.")))
        if not weights:
            raise VisionError("its checkpoint has no vision tower tensors (model.visual.*)")
        self.tower.load_weights(list(weights.items()))
        mx.eval(self.tower.parameters())
        self.processor = Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(path))
        self.merge = vc.spatial_merge_size
        self.image_token_id = int(config["image_token_id"])
        self.model = model
        section = config["text_config"]["rope_parameters"]["mrope_section"]
        if (why := mrope.install(model, section)) is not None:
            raise VisionError(why)

    # -- the gateway's side (CPU workers) ---------------------------------------

    def modules(self) -> list[nn.Module]:
        return [self.tower]

    def preprocess(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int], int]:
        """An RGB image (H, W, 3) uint8 -> (pixels, grid, tokens)."""
        out = self.processor([image.transpose(2, 0, 1)])
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        return out["pixel_values"], grid, grid[0] * grid[1] * grid[2] // self.merge**2

    def tokens_for(self, height: int, width: int) -> int:
        """An image's tokens, from its size alone (as preprocess will make them)."""
        return self.processor.num_image_tokens(height, width)

    def expand(self, prompt: Sequence[int], sizes: Sequence[int]) -> tuple[list[int], list[int]]:
        """The prompt with its i-th image token repeated sizes[i] times (the
        template writes the vision start and end around it), and each
        image's start."""
        return expand(prompt, sizes, self.image_token_id)

    # -- the engine's side (its thread, under the model's lock) ---------------

    def embeddings(self, embed, tokens: Sequence[int], start: int,
                   inside: Sequence[ImageInput]) -> mx.array:  # fmt: skip
        """Input embeddings (1, L, H) of prompt[start:start + L] = `tokens`,
        the placeholders of its images (`inside`) replaced by the tower's output."""
        text = embed(mx.array([list(tokens)]))
        if not inside:
            return text
        pixels = mx.array(np.concatenate([i.pixels for i in inside]))
        grids = mx.array([list(i.grid) for i in inside])
        features, _ = self.tower(pixels.astype(self.tower.patch_embed.proj.weight.dtype), grids)
        return splice(text, features.astype(text.dtype), start, inside)

    def prefill(self, run, cache: list, embed, prompt: Sequence[int], start: int, end: int,
                images: Sequence[ImageInput]) -> Any:  # fmt: skip
        """Feed prompt[start:end] (its images whole) into `cache`:
        `run(tokens (1, L), embeddings (1, L, H))` is the engine's forward;
        its result is returned. The cache is then an ordinary one
        (mrope.realign)."""
        tokens, inside = segment(prompt, start, end, images)
        emb = self.embeddings(embed, tokens, start, inside)
        local = [ImageInput(i.start - start, i.grid, i.length, i.pixels, i.digest) for i in inside]
        pos, after = mrope.positions(len(tokens), local, self.merge)
        with mrope.at_positions(pos):
            out = run(mx.array([tokens]), emb)
        mrope.realign(cache, self.model, len(tokens) - after)
        return out
