"""Tiny vision-language checkpoints in the published layouts.

Qwen3.5 is natively multimodal: its releases are Qwen3_5ForConditionalGeneration
with a vision tower (`model.visual.*`, a Qwen3-VL ViT: a Conv3d patch embed in
PyTorch's NCDHW order, learnt position embeddings, pre-norm blocks with one
fused qkv, a 2x2 patch merger into the text width), the image markers' ids at
the top of config.json beside `vision_config`, and a `preprocessor_config.json`
for Qwen3-VL's image processor. `build_qwen35_vl` writes the text model of
tiny.build_qwen35_hybrid (MTP head included) with such a tower.
"""

from __future__ import annotations

import json
from pathlib import Path

from ._build import _Init, save_safetensors, write_json
from .tiny import _TEXT, _qwen35_tensors, _qwen35_text_config, _write_rest
from .tokenizer import (
    CHAT_TEMPLATE,
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    build_tokenizer,
    vision_token_ids,
)

# ChatML with Qwen's image parts: each image (OpenAI's `image_url` part, or an
# `image` part as transformers' processors write it) is one
# <|vision_start|><|image_pad|><|vision_end|>; the processor then repeats the
# pad once per image token. Written here after Qwen3.5's convention.
_TEXT_PARTS = ("{%- for part in message['content'] if part['type'] == 'text' -%}"
               "{{- part['text'] -}}"
               "{%- endfor -%}")
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TEXT_PARTS, (
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}"
    "{{- '" + VISION_START + IMAGE_PAD + VISION_END + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"))
assert VISION_CHAT_TEMPLATE != CHAT_TEMPLATE


def _vision_config(*, depth: int, hidden_size: int, num_heads: int, out_hidden_size: int,
                   patch_size: int, num_position_embeddings: int) -> dict:  # fmt: skip
    return {
        "deepstack_visual_indexes": [],
        "depth": depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": hidden_size,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 2 * hidden_size,
        "model_type": "qwen3_5",
        "num_heads": num_heads,
        "num_position_embeddings": num_position_embeddings,
        "out_hidden_size": out_hidden_size,
        "patch_size": patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def _vision_tensors(init: _Init, vc: dict) -> dict:
    """The tower's tensors under `model.visual.`, as transformers saves them."""
    d, c, p, t = vc["hidden_size"], vc["in_channels"], vc["patch_size"], vc["temporal_patch_size"]
    inner, merged, out = vc["intermediate_size"], d * vc["spatial_merge_size"] ** 2, vc["out_hidden_size"]
    v = "model.visual."
    tensors = {
        f"{v}patch_embed.proj.weight": init.normal((d, c, t, p, p), 1.0 / (c * t * p * p) ** 0.5),
        f"{v}patch_embed.proj.bias": init.normal((d,), 0.02),
        f"{v}pos_embed.weight": init.normal((vc["num_position_embeddings"], d), 0.5),
    }
    for i in range(vc["depth"]):
        b = f"{v}blocks.{i}."
        tensors |= {
            f"{b}norm1.weight": init.norm(d, zero_centred=False),
            f"{b}norm1.bias": init.normal((d,), 0.02),
            f"{b}attn.qkv.weight": init.linear(3 * d, d),
            f"{b}attn.qkv.bias": init.normal((3 * d,), 0.02),
            f"{b}attn.proj.weight": init.linear(d, d, gain=0.5),
            f"{b}attn.proj.bias": init.normal((d,), 0.02),
            f"{b}norm2.weight": init.norm(d, zero_centred=False),
            f"{b}norm2.bias": init.normal((d,), 0.02),
            f"{b}mlp.linear_fc1.weight": init.linear(inner, d),
            f"{b}mlp.linear_fc1.bias": init.normal((inner,), 0.02),
            f"{b}mlp.linear_fc2.weight": init.linear(d, inner, gain=0.5),
            f"{b}mlp.linear_fc2.bias": init.normal((d,), 0.02),
        }
    # The merger normalizes each patch (width d), then projects 2x2 patches
    # (width 4d) into the text model's width. Gain 3 so that an image's
    # tokens move the text model as much as its words do.
    tensors |= {
        f"{v}merger.norm.weight": init.norm(d, zero_centred=False),
        f"{v}merger.norm.bias": init.normal((d,), 0.02),
        f"{v}merger.linear_fc1.weight": init.linear(merged, merged),
        f"{v}merger.linear_fc1.bias": init.normal((merged,), 0.02),
        f"{v}merger.linear_fc2.weight": init.linear(out, merged, gain=3.0),
        f"{v}merger.linear_fc2.bias": init.normal((out,), 0.02),
    }
    return tensors


def build_qwen35_vl(
    dest: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    vocab_size: int = 2048,
    vision_depth: int = 2,
    vision_hidden_size: int = 64,
    vision_num_heads: int = 2,
    patch_size: int = 16,
    num_position_embeddings: int = 64,
    max_image_pixels: int = 256 * 256,
    with_mtp: bool = True,
    dtype: str = "float32",
) -> Path:
    """Write a random Qwen3.5 vision-language hybrid to dest: the text model
    of tiny.build_qwen35_hybrid (same defaults, MTP head unless `with_mtp`
    is off), a Qwen3-VL tower, the image markers in the tokenizer and config,
    a template with image parts and Qwen3-VL's preprocessor_config.json
    (images resized to at most `max_image_pixels`). Deterministic in `seed`."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    text_config = _qwen35_text_config(
        dtype=dtype, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size, intermediate_size=2 * hidden_size, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=4,
        mtp_num_hidden_layers=1, max_position_embeddings=8192,
    )  # fmt: skip
    vision_config = _vision_config(
        depth=vision_depth, hidden_size=vision_hidden_size, num_heads=vision_num_heads,
        out_hidden_size=hidden_size, patch_size=patch_size,
        num_position_embeddings=num_position_embeddings,
    )  # fmt: skip
    tensors = _qwen35_tensors(seed, text_config, with_mtp)
    assert all(k.startswith((_TEXT, "lm_head", "mtp.")) for k in tensors)
    tensors |= _vision_tensors(_Init(seed + 1), vision_config)
    ids = vision_token_ids(vocab_size)
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": dtype,
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
        "text_config": text_config,
        "vision_config": vision_config,
        "tie_word_embeddings": False,
    }
    write_json(dest / "config.json", config)
    _write_rest(dest, vocab_size, tensors, dtype=dtype, tokenizer=False)
    build_tokenizer(dest, vocab_size=vocab_size, vision=True, chat_template=VISION_CHAT_TEMPLATE)
    factor = patch_size * 2
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": factor * factor, "longest_edge": max_image_pixels},
    }
    (dest / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    return dest


# Gemma-4's template writes one image token an image; its processor puts the
# image's soft tokens between begin- and end-of-image markers.
GEMMA4_CHAT_TEMPLATE = VISION_CHAT_TEMPLATE.replace(VISION_START + IMAGE_PAD + VISION_END, IMAGE_PAD)


def _gemma4_vision_tensors(init: _Init, vc: dict, text_hidden: int) -> dict:
    """Gemma-4's tower under `model.vision_tower.` and its projection into
    the text width, `model.embed_vision.`, as transformers saves them."""
    d, hd, inner, p = vc["hidden_size"], vc["head_dim"], vc["intermediate_size"], vc["patch_size"]
    heads, kv = vc["num_attention_heads"], vc["num_key_value_heads"]
    v = "model.vision_tower."
    tensors = {
        f"{v}patch_embedder.input_proj.weight": init.linear(d, 3 * p * p),
        f"{v}patch_embedder.position_embedding_table": init.normal((2, vc["position_embedding_size"], d), 0.5),
    }
    for i in range(vc["num_hidden_layers"]):
        b = f"{v}encoder.layers.{i}."
        tensors |= {
            f"{b}self_attn.q_proj.linear.weight": init.linear(heads * hd, d),
            f"{b}self_attn.k_proj.linear.weight": init.linear(kv * hd, d),
            f"{b}self_attn.v_proj.linear.weight": init.linear(kv * hd, d),
            f"{b}self_attn.o_proj.linear.weight": init.linear(d, heads * hd, gain=0.5),
            f"{b}self_attn.q_norm.weight": init.norm(hd, zero_centred=False),
            f"{b}self_attn.k_norm.weight": init.norm(hd, zero_centred=False),
            f"{b}mlp.gate_proj.linear.weight": init.linear(inner, d),
            f"{b}mlp.up_proj.linear.weight": init.linear(inner, d),
            f"{b}mlp.down_proj.linear.weight": init.linear(d, inner, gain=0.5),
        }
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            tensors[f"{b}{norm}.weight"] = init.norm(d, zero_centred=False)
    # Gain 3: an image's tokens move the text model as much as its words do.
    tensors["model.embed_vision.embedding_projection.weight"] = init.linear(text_hidden, d, gain=3.0)
    return tensors


def build_gemma4_vl(dest: Path, *, seed: int = 0, vocab_size: int = 2048, max_soft_tokens: int = 16,
                    dtype: str = "float32") -> Path:  # fmt: skip
    """Write a random Gemma-4 vision-language model to dest: the dense text
    model of gemma4.build_gemma4, attending both ways within an image's
    tokens (`use_bidirectional_attention: "vision"`, as released), a
    Gemma-4 tower (patches pooled 3x3 into soft tokens), the image markers
    in config.json and the tokenizer, a template with image parts and
    Gemma-4's processor_config.json (at most `max_soft_tokens` an image).
    Deterministic in `seed`."""
    from safetensors.numpy import load_file

    from .gemma4 import build_gemma4

    dest = build_gemma4(Path(dest), seed=seed, vocab_size=vocab_size, dtype=dtype, tokenizer=False)
    config = json.loads((dest / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    vc = {
        "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
        "global_head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 64,
        "default_output_length": max_soft_tokens, "standardize": False, "use_clipped_linears": False,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    }  # fmt: skip
    ids = vision_token_ids(vocab_size)
    config |= {"vision_config": vc, "image_token_id": ids[IMAGE_PAD], "boi_token_id": ids[VISION_START],
               "eoi_token_id": ids[VISION_END], "vision_soft_tokens_per_image": max_soft_tokens}  # fmt: skip
    write_json(dest / "config.json", config)
    tensors = load_file(str(dest / "model.safetensors"))
    tensors |= _gemma4_vision_tensors(_Init(seed + 1), vc, config["text_config"]["hidden_size"])
    save_safetensors(dest, tensors, dtype)
    build_tokenizer(dest, vocab_size=vocab_size, vision=True, chat_template=GEMMA4_CHAT_TEMPLATE)
    # transformers reads these as the tokenizer's boi_token, eoi_token and
    # image_token, which Gemma-4's processor asks for.
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    tok_config["extra_special_tokens"] = {"boi_token": VISION_START, "eoi_token": VISION_END,
                                          "image_token": IMAGE_PAD}  # fmt: skip
    write_json(dest / "tokenizer_config.json", tok_config)
    # As Gemma-4's releases ship it: processor_config.json, the image
    # processor's settings nested.
    processor = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": max_soft_tokens,
        "image_processor": {
            "image_processor_type": "Gemma4ImageProcessor",
            "do_convert_rgb": True, "do_normalize": False, "do_rescale": True, "do_resize": True,
            "rescale_factor": 1 / 255, "resample": 3, "image_mean": [0.0, 0.0, 0.0],
            "image_std": [1.0, 1.0, 1.0], "patch_size": 16, "pooling_kernel_size": 3,
            "max_soft_tokens": max_soft_tokens,
        },
    }  # fmt: skip
    (dest / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return dest
