"""Tiny Gemma-4 targets in Google's published layout (Gemma4ForConditionalGeneration).

The text path only: `config.json` nests the language model's keys in
`text_config` (model_type gemma4_text) and the tensors sit under
`model.language_model.`; no vision or audio tower is written (mlx-lm's
sanitize drops them). Three shapes of the family:
- dense (31B-like): sliding layers then a full one, in a 5:1 pattern;
- MoE (26B-A4B-like): each layer has a dense MLP *and* routed experts
  (`router.{proj,scale,per_expert_scale}`, fused `experts.gate_up_proj
  [E, 2I, H]` / `experts.down_proj [E, H, I]`), full layers with keys as
  values (`attention_k_eq_v`, no v_proj) and their own KV head count;
- small (E2B/E4B-like): per-layer input embeddings and KV-shared last layers
  (their k/v projections are still stored: mlx-lm's sanitize drops them).
Norms are Gemma-4's: RMSNorm scales by the stored weight itself (`x * w`,
stored near 1), and `layer_scalar` multiplies the layer's output (`h * s`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ._build import Tensors, _Init, glu, save_safetensors, write_generation_config, write_json
from .tokenizer import ENDOFTEXT, IM_END, build_tokenizer, special_token_ids

_TEXT = "model.language_model."


def gemma4_text_config_layer_types(n: int, pattern: int) -> list[str]:
    """`pattern - 1` sliding layers then a full one, repeated; the last layer
    is full, as in the releases."""
    kinds = ((["sliding_attention"] * (pattern - 1) + ["full_attention"]) * n)[:n]
    kinds[-1] = "full_attention"
    return kinds


def gemma4_text_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    global_head_dim: int,
    sliding_window: int,
    sliding_window_pattern: int,
    num_kv_shared_layers: int,
    hidden_size_per_layer_input: int,
    moe: bool,
    max_position_embeddings: int,
    dtype: str,
) -> dict:
    layer_types = gemma4_text_config_layer_types(num_hidden_layers, sliding_window_pattern)
    return {
        "model_type": "gemma4_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": moe,
        "dtype": dtype,
        "enable_moe_block": moe,
        "final_logit_softcapping": 30.0,
        "global_head_dim": global_head_dim,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden_size,
        "hidden_size_per_layer_input": hidden_size_per_layer_input,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": layer_types,
        "max_position_embeddings": max_position_embeddings,
        "moe_intermediate_size": intermediate_size // 2 if moe else None,
        "num_attention_heads": num_attention_heads,
        "num_experts": 4 if moe else None,
        "num_global_key_value_heads": 1 if moe else None,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "num_kv_shared_layers": num_kv_shared_layers,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        "sliding_window": sliding_window,
        "tie_word_embeddings": True,
        "top_k_experts": 2 if moe else None,
        "use_double_wide_mlp": False,
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size if hidden_size_per_layer_input else 0,
    }


def _norm(init: _Init, dim: int) -> np.ndarray:
    return init.norm(dim, zero_centred=False)  # Gemma-4: x * w, w stored near 1


def _layer(init: _Init, p: str, tc: dict, kind: str) -> Tensors:
    h = tc["hidden_size"]
    full = kind == "full_attention"
    hd = tc["global_head_dim"] if full else tc["head_dim"]
    k_eq_v = tc["attention_k_eq_v"] and full
    n_kv = tc["num_global_key_value_heads"] if k_eq_v else tc["num_key_value_heads"]
    a = f"{p}self_attn."
    t = {
        f"{a}q_proj.weight": init.linear(tc["num_attention_heads"] * hd, h),
        f"{a}k_proj.weight": init.linear(n_kv * hd, h),
    }
    if not k_eq_v:
        t[f"{a}v_proj.weight"] = init.linear(n_kv * hd, h)
    t |= {
        f"{a}o_proj.weight": init.linear(h, tc["num_attention_heads"] * hd),
        f"{a}q_norm.weight": _norm(init, hd),
        f"{a}k_norm.weight": _norm(init, hd),
    }
    for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
        t[f"{p}{norm}_layernorm.weight"] = _norm(init, h)
    t |= glu(init, f"{p}mlp.", h, tc["intermediate_size"])
    if tc["enable_moe_block"]:
        n_e, inter = tc["num_experts"], tc["moe_intermediate_size"]
        t |= {
            f"{p}router.proj.weight": init.linear(n_e, h),
            f"{p}router.scale": _norm(init, h),
            f"{p}router.per_expert_scale": _norm(init, n_e),
            f"{p}experts.gate_up_proj": init.normal((n_e, 2 * inter, h), 1 / np.sqrt(h)),
            f"{p}experts.down_proj": init.normal((n_e, h, inter), 1 / np.sqrt(inter)),
            f"{p}pre_feedforward_layernorm_2.weight": _norm(init, h),
            f"{p}post_feedforward_layernorm_1.weight": _norm(init, h),
            f"{p}post_feedforward_layernorm_2.weight": _norm(init, h),
        }
    if pl := tc["hidden_size_per_layer_input"]:
        t |= {
            f"{p}per_layer_input_gate.weight": init.linear(pl, h),
            f"{p}per_layer_projection.weight": init.linear(h, pl),
            f"{p}post_per_layer_input_norm.weight": _norm(init, h),
        }
    # Scales the whole residual stream at the layer's end.
    t[f"{p}layer_scalar"] = init.rng.uniform(0.5, 1.0, (1,)).astype(np.float32)
    return t


def gemma4_tensors(seed: int, tc: dict) -> Tensors:
    init = _Init(seed)
    h, vocab, n = tc["hidden_size"], tc["vocab_size"], tc["num_hidden_layers"]
    # Tied head: the input is the row times sqrt(H) (RMS = the row's norm),
    # the logits' std on a unit-RMS hidden state is that norm too. Rows of
    # norm 0.5 keep the input a small part of the residual stream: larger,
    # a random model's last hidden state points at the token it was fed
    # and it repeats that token forever.
    tensors = {f"{_TEXT}embed_tokens.weight": init.normal((vocab, h), 0.5 / np.sqrt(h))}
    for i, kind in enumerate(tc["layer_types"]):
        tensors |= _layer(init, f"{_TEXT}layers.{i}.", tc, kind)
    if pl := tc["hidden_size_per_layer_input"]:
        tensors |= {
            f"{_TEXT}embed_tokens_per_layer.weight": init.normal((vocab, n * pl), 1 / np.sqrt(pl)),
            f"{_TEXT}per_layer_model_projection.weight": init.linear(n * pl, h),
            f"{_TEXT}per_layer_projection_norm.weight": _norm(init, pl),
        }
    tensors[f"{_TEXT}norm.weight"] = _norm(init, h)
    return tensors


def build_gemma4(
    dest: Path,
    *,
    variant: str = "dense",
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_hidden_layers: int | None = None,
    intermediate_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    global_head_dim: int = 64,
    sliding_window: int = 16,
    sliding_window_pattern: int = 3,
    max_position_embeddings: int = 131072,
    dtype: str = "float32",
    tokenizer: bool = True,
) -> Path:
    """Write a random Gemma-4 (Gemma4ForConditionalGeneration, text path) to dest.

    variant: "dense", "moe" (26B-A4B-like) or "small" (E2B/E4B-like:
    per-layer inputs, the last third of the layers KV-shared). Layers: 6, or
    9 for "small", whose layers that keep a cache must end on a sliding then
    a full layer as the released ones do (llama.cpp maps each KV-shared
    layer to the last or second-to-last of them by that rule). The sliding
    window is small so that short prompts wrap it.
    """
    if variant not in ("dense", "moe", "small"):
        raise ValueError(f"variant must be dense, moe or small, got {variant!r}")
    small = variant == "small"
    num_hidden_layers = num_hidden_layers or (9 if small else 6)
    if small:
        kinds = gemma4_text_config_layer_types(num_hidden_layers, sliding_window_pattern)
        owning = kinds[: num_hidden_layers - num_hidden_layers // 3]
        if owning[-2:] != ["sliding_attention", "full_attention"]:
            raise ValueError(f"{num_hidden_layers} layers with a full one every "
                             f"{sliding_window_pattern}: the layers that keep a cache end on "
                             f"{owning[-2:]}, not a sliding then a full layer")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tc = gemma4_text_config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        global_head_dim=global_head_dim, sliding_window=sliding_window,
        sliding_window_pattern=sliding_window_pattern,
        num_kv_shared_layers=num_hidden_layers // 3 if small else 0,
        hidden_size_per_layer_input=16 if small else 0, moe=variant == "moe",
        max_position_embeddings=max_position_embeddings, dtype=dtype,
    )  # fmt: skip
    specials = special_token_ids(vocab_size)
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": tc,
        # mlx-lm's gemma4 takes the vocabulary from the top level (the
        # releases' 262144 is its default); a tiny one must say its own.
        "vocab_size": vocab_size,
        "bos_token_id": specials[ENDOFTEXT],
        "eos_token_id": [specials[IM_END], specials[ENDOFTEXT]],
        "pad_token_id": specials[ENDOFTEXT],
        "tie_word_embeddings": True,
        "dtype": dtype,
    }
    write_json(dest / "config.json", config)
    write_generation_config(dest, vocab_size)
    save_safetensors(dest, gemma4_tensors(seed, tc), dtype)
    if tokenizer:
        build_tokenizer(dest, vocab_size=vocab_size)
    return dest
