"""Images in a prompt, for a vision-language target.

A vision-language checkpoint (Qwen3.5's or Gemma-4's published layout:
`vision_config` beside the text model) is loaded as today for its text
model, by mlx-lm, so every engine and drafter runs on it unchanged; its
image side (`load`: one module per family, qwen3_5.py and gemma4.py) comes
from mlx-vlm (the optional extra `specgate-llm[vision]`): the family's
image processor (numpy, run by the gateway's CPU workers) and its vision
tower (MLX, run by the engine on its own thread under the model's lock, as
a prefill chunk is).

An image's prompt tokens are placeholders (the model's image token, once
per image token). The engine prefills the prompt from its first uncached
image to its last in one forward whose input embeddings are the text's,
with the tower's output in place of the placeholders, under what the
family needs there (Qwen: multimodal positions, mrope.py; Gemma-4: each
image's tokens attending to each other both ways). The rest of the prompt
and every decoding round are plain text, so MTP, n-gram, block and
assistant drafting run after the image tokens as after any others, exactly
(tests/test_vision.py). The prefix cache keys an image's placeholders by
its digest (GenerationRequest.cache_key).

A family's image side offers: `preprocess(image)` -> (pixels, grid,
tokens); `tokens_for(height, width)`; `expand(prompt, sizes)` -> the
prompt with each image marker grown to its tokens, and where each image's
tokens start; `prefill(run, cache, embed, prompt, start, end, images)`;
`modules()`, the MLX modules it holds beside the text model (its tower and
projection), whose weights the engines report as the model's.
May import engines/ (its types) and mlx-vlm, only where an image side is
built (it is an optional extra); see docs/DESIGN.md, "Images".
"""

from __future__ import annotations

import mlx.nn as nn

from specgate.engines.vision.family import VisionError

__all__ = ["FAMILIES", "VisionError", "load", "unsupported"]

# Families whose image side is served, by the checkpoint's model_type.
FAMILIES = ("qwen3_5", "qwen3_5_moe", "gemma4")


def unsupported(config: dict) -> str | None:
    """Why this checkpoint's images cannot be served, or None. (A checkpoint
    without a `vision_config` is a text model: not asked.)"""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        return f"images are served for {', '.join(FAMILIES)} checkpoints, not {kind!r}"
    rope = (config.get("text_config") or {}).get("rope_parameters") or {}
    if kind.startswith("qwen") and not rope.get("mrope_interleaved", False):
        return "its text model's positions are not interleaved M-RoPE"
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return "mlx-vlm is not installed (pip install 'specgate-llm[vision]')"
    return None


def load(path: str, config: dict, model: nn.Module):
    """The image side of a loaded checkpoint (`unsupported` said None)."""
    if config["model_type"] == "gemma4":
        from specgate.engines.vision.gemma4 import GemmaVision

        return GemmaVision(path, config, model)
    from specgate.engines.vision.qwen3_5 import QwenVision

    return QwenVision(path, config, model)
