"""Tiny random-weight checkpoints in exactly the published Hugging Face layout.

Tests and the demo model need checkpoints whose config keys, tensor names,
shapes and norm conventions are those of the real releases, so that every
loader (mlx-lm's sanitize, our MTP head reader, `inspect`) is exercised on
what it will meet in the wild. Only the sizes are small and the weights random.

Targets live here (Qwen3.5 hybrid and MoE, Qwen3 dense), in qwen3_next.py and
gemma4.py;
drafters (DFlash, DSpark, Gemma-4 assistant) in drafters.py; helpers that
reproduce known conversion traps in traps.py. All public builders and the
trap helpers are importable from this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from ._build import (
    Tensors,
    _Init,
    attention,
    decoder_layer,
    gated_delta_net,
    save_safetensors,
    sparse_moe,
    write_generation_config,
    write_json,
)
from .gemma4 import build_gemma4
from .qwen3_next import build_qwen3_next
from .tokenizer import ENDOFTEXT, IM_END, build_tokenizer, special_token_ids
from .traps import apply_double_norm_shift, apply_gemma4_norm_shift, strip_mtp

__all__ = [
    "LAYOUT_CONFIRMED",
    "UNCONFIRMED",
    "apply_double_norm_shift",
    "apply_gemma4_norm_shift",
    "build_gemma4",
    "build_qwen3_dense",
    "build_qwen3_next",
    "build_qwen35_hybrid",
    "build_qwen35_moe",
    "strip_mtp",
]

# Whether each builder's file layout (tensor names, shapes, config keys) was
# checked against source code or published file listings (True), or had to be
# inferred from modeling code because no published file was found (False).
# `inspect` reads this to say how far a verdict on such a layout can be trusted.
LAYOUT_CONFIRMED: dict[str, bool] = {
    "build_qwen35_hybrid": True,
    "build_qwen35_moe": True,
    "build_qwen3_dense": True,
    "build_qwen3_next": True,
    "build_dflash_drafter": True,
    # DeepSpec's module tree gives the names, but no published DSpark
    # checkpoint (file listing or loader) was found.
    "build_dspark_drafter": False,
    "build_gemma4_assistant": True,
    "build_gemma4": True,
}

# Points inside an otherwise confirmed layout that no source settled.
UNCONFIRMED: dict[str, tuple[str, ...]] = {
    "build_qwen3_next": (
        "the MTP declaration key: none is written by default (see qwen3_next.py)",
    ),
    "build_dflash_drafter": (
        "mask_token_id: Qwen3 releases use the first id past the tokenizer, an "
        "unused embedding row; the tiny target has none, so the last BPE id is used",
        "layer_types in config.json: written as transformers >= 4.56 saves Qwen3 configs",
    ),
    "build_gemma4": (
        "the top-level vocab_size: mlx-lm's gemma4 reads the vocabulary there (its "
        "default is the releases' 262144); a tiny vocabulary must be written there too",
        "no vision or audio tower tensors are written (the text path only)",
    ),
    "build_dspark_drafter": (
        "the whole file layout: names follow Qwen3DSparkModel's modules, "
        "unprefixed, with its frozen embed_tokens and lm_head saved",
    ),
}

_TEXT = "model.language_model."
# How a checkpoint stores MoE experts (see build_qwen35_moe).
ExpertLayout = Literal["fused", "per_expert"]


def _qwen35_layer(
    init: _Init, prefix: str, tc: dict, kind: str, *, fused_experts: bool | None = None
) -> Tensors:
    """One Qwen3.5 decoder layer; `fused_experts` None means a dense MLP."""
    if kind == "linear_attention":
        mixer = gated_delta_net(init, prefix, tc)
    else:
        mixer = attention(init, prefix, tc, output_gate=True, zero_centred=True)
    ffn = None
    if fused_experts is not None:

        def ffn() -> Tensors:
            return sparse_moe(init, prefix, tc, fused_experts=fused_experts)

    return decoder_layer(init, prefix, tc, mixer=mixer, zero_centred=True, ffn=ffn)


def _qwen35_tensors(
    seed: int,
    tc: dict,
    with_mtp: bool,
    *,
    fused_experts: bool | None = None,
    mtp_fused_experts: bool | None = None,
) -> Tensors:
    init = _Init(seed)
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    tensors = {f"{_TEXT}embed_tokens.weight": init.normal((vocab, h), 1.0)}
    for i, kind in enumerate(tc["layer_types"]):
        tensors |= _qwen35_layer(init, f"{_TEXT}layers.{i}.", tc, kind, fused_experts=fused_experts)
    tensors[f"{_TEXT}norm.weight"] = init.norm(h, zero_centred=True)
    # Gain 3 on a unit-RMS final hidden state gives logits of std ~3.
    tensors["lm_head.weight"] = init.linear(vocab, h, gain=3.0)
    if with_mtp and tc["mtp_num_hidden_layers"] > 0:
        # The MTP head sits at the top level, outside model.language_model.,
        # and has no embedding or lm_head of its own (it shares the trunk's).
        tensors |= {
            "mtp.pre_fc_norm_embedding.weight": init.norm(h, zero_centred=True),
            "mtp.pre_fc_norm_hidden.weight": init.norm(h, zero_centred=True),
            "mtp.fc.weight": init.linear(h, 2 * h),  # input is [embedding, hidden]
        }
        for j in range(tc["mtp_num_hidden_layers"]):
            tensors |= _qwen35_layer(
                init, f"mtp.layers.{j}.", tc, "full_attention", fused_experts=mtp_fused_experts
            )
        tensors["mtp.norm.weight"] = init.norm(h, zero_centred=True)
    return tensors


def _mrope_section(rotary_dim: int) -> list[int]:
    """Qwen's [11, 11, 10] split of rotary_dim / 2, scaled to this head size."""
    half = rotary_dim // 2
    side = round(half * 11 / 32)
    return [side, side, half - 2 * side]


def _qwen35_text_config(
    *,
    dtype: str,
    hidden_size: int,
    num_hidden_layers: int,
    vocab_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    linear_num_key_heads: int,
    linear_num_value_heads: int,
    linear_key_head_dim: int,
    linear_value_head_dim: int,
    full_attention_interval: int,
    mtp_num_hidden_layers: int,
    max_position_embeddings: int,
) -> dict:
    """Qwen3.5's text_config (model_type qwen3_5_text), keys as Qwen writes them."""
    specials = special_token_ids(vocab_size)
    partial_rotary_factor = 0.25
    return {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": specials[ENDOFTEXT],
        "eos_token_id": specials[IM_END],
        "dtype": dtype,
        "full_attention_interval": full_attention_interval,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(num_hidden_layers)
        ],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_value_head_dim": linear_value_head_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": max_position_embeddings,
        "mtp_num_hidden_layers": mtp_num_hidden_layers,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "pad_token_id": None,
        "partial_rotary_factor": partial_rotary_factor,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(int(head_dim * partial_rotary_factor)),
            "partial_rotary_factor": partial_rotary_factor,
            "rope_theta": 10_000_000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _write_qwen35(
    dest: Path,
    architecture: str,
    model_type: str,
    text_config: dict,
    tensors: Tensors,
    *,
    dtype: str,
    tokenizer: bool,
) -> Path:
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "dtype": dtype,
        "text_config": text_config,
        "tie_word_embeddings": False,
    }
    write_json(dest / "config.json", config)
    return _write_rest(dest, text_config["vocab_size"], tensors, dtype=dtype, tokenizer=tokenizer)


def _write_rest(dest: Path, vocab_size: int, tensors: Tensors, *, dtype: str, tokenizer: bool) -> Path:
    write_generation_config(dest, vocab_size)
    save_safetensors(dest, tensors, dtype)
    if tokenizer:
        build_tokenizer(dest, vocab_size=vocab_size)
    return dest


# What save_pretrained writes as transformers_version in a text-only save.
_TRANSFORMERS_VERSION = "5.24.0"


def _write_qwen35_text_only(
    dest: Path, architecture: str, text_config: dict, tensors: Tensors, *, dtype: str,
    tokenizer: bool,
) -> Path:
    """The text model saved alone, as transformers' Qwen3_5ForCausalLM (and
    Qwen3_5MoeForCausalLM) save_pretrained writes it: the text config flat at
    the top (model_type qwen3_5_text / qwen3_5_moe_text, keys sorted, the
    rotary factor only inside rope_parameters), weights under `model.` and no
    `mtp.*` (transformers ignores the head on load, so a re-save drops it;
    mtp_num_hidden_layers stays in the config)."""
    config = {k: v for k, v in text_config.items() if k != "partial_rotary_factor"}
    config |= {"architectures": [architecture], "transformers_version": _TRANSFORMERS_VERSION}
    write_json(dest / "config.json", dict(sorted(config.items())))
    flat = {("model." + k[len(_TEXT):] if k.startswith(_TEXT) else k): v
            for k, v in tensors.items() if not k.startswith("mtp.")}
    return _write_rest(dest, text_config["vocab_size"], flat, dtype=dtype, tokenizer=tokenizer)


def build_qwen35_hybrid(
    dest: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    vocab_size: int = 2048,
    intermediate_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 32,
    linear_value_head_dim: int = 32,
    full_attention_interval: int = 4,
    mtp_num_hidden_layers: int = 1,
    max_position_embeddings: int = 8192,
    dtype: str = "float32",
    with_mtp: bool = True,
    tokenizer: bool = True,
    text_only: bool = False,
    aligned_mtp: bool = False,
) -> Path:
    """Write a random Qwen3.5 hybrid (GatedDeltaNet + gated attention) to dest.

    The layout is Qwen's published one: nested config.json, tensors under
    `model.language_model.`, top-level `lm_head` and `mtp.*`, zero-centred
    norms, HF conv1d layout. `with_mtp=False` keeps `mtp_num_hidden_layers` in
    the config but writes no `mtp.*` tensors, as some conversions do.
    `dtype` is float32, float16 or bfloat16. Deterministic in `seed`.
    `text_only=True` writes the same weights as transformers saves the text
    model alone (Qwen3_5ForCausalLM: flat config, `model.*`, no `mtp.*`; see
    _write_qwen35_text_only). `aligned_mtp=True` makes the MTP head draft
    exactly the trunk's next token (see _align_mtp): acceptance 1 at
    temperature 0, where a random head's is about 0.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    text_config = _qwen35_text_config(
        dtype=dtype,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        full_attention_interval=full_attention_interval,
        mtp_num_hidden_layers=mtp_num_hidden_layers,
        max_position_embeddings=max_position_embeddings,
    )
    tensors = _qwen35_tensors(seed, text_config, with_mtp)
    if aligned_mtp:
        _align_mtp(tensors)
    if text_only:
        return _write_qwen35_text_only(dest, "Qwen3_5ForCausalLM", text_config, tensors,
                                       dtype=dtype, tokenizer=tokenizer)
    return _write_qwen35(
        dest,
        "Qwen3_5ForConditionalGeneration",
        "qwen3_5",
        text_config,
        tensors,
        dtype=dtype,
        tokenizer=tokenizer,
    )


def _align_mtp(tensors: Tensors) -> None:
    """With every residual branch zeroed the trunk is a bigram model,
    lm_head(norm(embed(x))); with fc = [I | 0] and unit norms the MTP head
    computes the same function of the token it is fed, so every draft is the
    trunk's own next token."""
    for k, v in tensors.items():
        if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensors[k] = np.zeros_like(v)
        elif k.endswith("norm.weight") and "linear_attn" not in k or k.startswith("mtp.pre_fc"):
            tensors[k] = np.zeros_like(v)  # zero-centred: effective scale 1
    h = tensors["mtp.fc.weight"].shape[0]
    tensors["mtp.fc.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(
        tensors["mtp.fc.weight"].dtype)


def build_qwen35_moe(
    dest: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    vocab_size: int = 2048,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 32,
    linear_value_head_dim: int = 32,
    full_attention_interval: int = 4,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 64,
    mtp_num_hidden_layers: int = 1,
    max_position_embeddings: int = 8192,
    experts: ExpertLayout = "fused",
    mtp_experts: ExpertLayout = "per_expert",
    dtype: str = "float32",
    with_mtp: bool = True,
    tokenizer: bool = True,
    text_only: bool = False,
) -> Path:
    """Write a random Qwen3.5 MoE hybrid (Qwen3_5MoeForConditionalGeneration) to dest.

    As the Qwen3.5 hybrid, with every MLP replaced by Qwen's sparse MoE
    block: router `mlp.gate [E, H]`, routed experts, `shared_expert.*` and
    `shared_expert_gate [1, H]`; the text_config (`qwen3_5_moe_text`) has no
    `intermediate_size`, only the MoE widths.

    Expert layouts, from published index files (as reported in
    vllm-project/llm-compressor#3037, THUDM/slime#1904, ISEEKYAN/mbridge#145):
    Qwen3.5-35B-A3B (bf16) stores the trunk's experts fused (`experts="fused"`:
    `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`, no
    `.weight`) but its MTP layer's per expert (`mtp_experts="per_expert"`:
    `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`); Qwen3.6-35B-A3B
    stores the MTP experts fused too (`mtp_experts="fused"`). The FP8 release
    and re-saved derivatives store the trunk per expert (`experts="per_expert"`),
    which mlx-lm 0.32's qwen3_5_moe sanitize cannot load.
    `text_only=True`: as Qwen3_5MoeForCausalLM saves it (flat config,
    `model.*`, no `mtp.*`); transformers keeps its experts fused.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    dense = _qwen35_text_config(
        dtype=dtype,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size,
        intermediate_size=0,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        full_attention_interval=full_attention_interval,
        mtp_num_hidden_layers=mtp_num_hidden_layers,
        max_position_embeddings=max_position_embeddings,
    )
    del dense["model_type"], dense["intermediate_size"]
    dense |= {
        "moe_intermediate_size": moe_intermediate_size,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
    }
    text_config = {"model_type": "qwen3_5_moe_text", **dict(sorted(dense.items()))}
    tensors = _qwen35_tensors(
        seed,
        text_config,
        with_mtp,
        fused_experts=experts == "fused",
        mtp_fused_experts=mtp_experts == "fused",
    )
    if text_only:
        return _write_qwen35_text_only(dest, "Qwen3_5MoeForCausalLM", text_config, tensors,
                                       dtype=dtype, tokenizer=tokenizer)
    return _write_qwen35(
        dest,
        "Qwen3_5MoeForConditionalGeneration",
        "qwen3_5_moe",
        text_config,
        tensors,
        dtype=dtype,
        tokenizer=tokenizer,
    )


def _qwen3_tensors(seed: int, cfg: dict) -> Tensors:
    init = _Init(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    tied = cfg["tie_word_embeddings"]
    # Tied, the embedding is also the output head: scale it for logits of std ~3.
    tensors = {"model.embed_tokens.weight": init.normal((vocab, h), 3 / np.sqrt(h) if tied else 1)}
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        mixer = attention(init, prefix, cfg, output_gate=False, zero_centred=False)
        tensors |= decoder_layer(init, prefix, cfg, mixer=mixer, zero_centred=False)
    tensors["model.norm.weight"] = init.norm(h, zero_centred=False)
    if not tied:
        tensors["lm_head.weight"] = init.linear(vocab, h, gain=3.0)
    return tensors


def build_qwen3_dense(
    dest: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    vocab_size: int = 2048,
    intermediate_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 8192,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    tokenizer: bool = True,
) -> Path:
    """Write a random Qwen3 dense model (Qwen3ForCausalLM) to dest.

    Qwen3's published layout: flat config.json, tensors under `model.`, plain
    (not zero-centred) RMSNorms, q/k norms, no MTP head. Qwen3 is the target
    family of the public DFlash and DSpark drafters.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    specials = special_token_ids(vocab_size)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": specials[ENDOFTEXT],
        "eos_token_id": specials[IM_END],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_hidden_layers,
        "model_type": "qwen3",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1_000_000,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    write_json(dest / "config.json", config)
    write_generation_config(dest, vocab_size)
    save_safetensors(dest, _qwen3_tensors(seed, config), dtype)
    if tokenizer:
        build_tokenizer(dest, vocab_size=vocab_size)
    return dest
