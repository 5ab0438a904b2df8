"""Tiny random-weight checkpoints in exactly the published Hugging Face layout.

Tests and the demo model need checkpoints whose config keys, tensor names,
shapes and norm conventions are those of the real releases, so that every
loader (mlx-lm's sanitize, our MTP head reader, `inspect`) is exercised on
what it will meet in the wild. Only the sizes are small and the weights random.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .tokenizer import ENDOFTEXT, IM_END, build_tokenizer, special_token_ids

_TEXT = "model.language_model."


class _Init:
    """Draws every tensor from one seeded generator, in a fixed order.

    The gains are chosen so that a random model still behaves like a language
    model numerically: residual branches contribute O(1), the GDN recurrence
    carries context without blowing up or forgetting at once, and the logits are spread (std ~3) so
    greedy decoding is not decided by near-ties.
    """

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def linear(self, out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        return self.normal((out_dim, in_dim), gain / np.sqrt(in_dim))

    def norm(self, dim: int, *, zero_centred: bool) -> np.ndarray:
        # Qwen3.5 stores RMSNorm weights as w with effective scale 1 + w;
        # Qwen3 and the GDN gated norm store the scale itself.
        w = self.normal((dim,), 0.1)
        return w if zero_centred else 1.0 + w


def _mlp(init: _Init, prefix: str, hidden: int, inter: int) -> dict[str, np.ndarray]:
    return {
        f"{prefix}mlp.gate_proj.weight": init.linear(inter, hidden),
        f"{prefix}mlp.up_proj.weight": init.linear(inter, hidden),
        f"{prefix}mlp.down_proj.weight": init.linear(hidden, inter),
    }


def _attention(
    init: _Init, prefix: str, tc: dict, *, output_gate: bool, zero_centred: bool
) -> dict[str, np.ndarray]:
    h, hd = tc["hidden_size"], tc["head_dim"]
    n_q, n_kv = tc["num_attention_heads"], tc["num_key_value_heads"]
    p = f"{prefix}self_attn."
    return {
        # With an output gate, q_proj gives [query | gate] per head.
        f"{p}q_proj.weight": init.linear((2 if output_gate else 1) * n_q * hd, h),
        f"{p}k_proj.weight": init.linear(n_kv * hd, h),
        f"{p}v_proj.weight": init.linear(n_kv * hd, h),
        f"{p}o_proj.weight": init.linear(h, n_q * hd),
        f"{p}q_norm.weight": init.norm(hd, zero_centred=zero_centred),
        f"{p}k_norm.weight": init.norm(hd, zero_centred=zero_centred),
    }


def _gated_delta_net(init: _Init, prefix: str, tc: dict) -> dict[str, np.ndarray]:
    h = tc["hidden_size"]
    n_v = tc["linear_num_value_heads"]
    key_dim = tc["linear_num_key_heads"] * tc["linear_key_head_dim"]
    value_dim = n_v * tc["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    kernel = tc["linear_conv_kernel_dim"]
    # Decay g = exp(-exp(A_log) * softplus(a + dt_bias)): A in [1, 8] and a
    # Mamba-style dt in [0.01, 0.1] keep g in roughly [0.45, 0.99], so state
    # lasts a few to a hundred tokens (HF's init, A up to 16 with dt_bias 1,
    # would forget almost everything at every step).
    dt = np.exp(init.rng.uniform(np.log(0.01), np.log(0.1), n_v))
    p = f"{prefix}linear_attn."
    return {
        f"{p}in_proj_qkv.weight": init.linear(conv_dim, h),
        f"{p}in_proj_z.weight": init.linear(value_dim, h),
        f"{p}in_proj_b.weight": init.linear(n_v, h),
        f"{p}in_proj_a.weight": init.linear(n_v, h, gain=0.5),
        # HF Conv1d layout [channels, 1, kernel]; mlx-lm moves the axes.
        f"{p}conv1d.weight": init.normal((conv_dim, 1, kernel), 1 / np.sqrt(kernel)),
        f"{p}dt_bias": (dt + np.log(-np.expm1(-dt))).astype(np.float32),  # softplus^-1
        f"{p}A_log": np.log(init.rng.uniform(1.0, 8.0, n_v)).astype(np.float32),
        # The gated norm is not zero-centred, unlike every other Qwen3.5 norm.
        f"{p}norm.weight": init.norm(tc["linear_value_head_dim"], zero_centred=False),
        f"{p}out_proj.weight": init.linear(h, value_dim),
    }


def _decoder_layer(
    init: _Init, prefix: str, tc: dict, *, mixer: dict[str, np.ndarray], zero_centred: bool
) -> dict[str, np.ndarray]:
    h = tc["hidden_size"]
    return {
        f"{prefix}input_layernorm.weight": init.norm(h, zero_centred=zero_centred),
        **mixer,
        f"{prefix}post_attention_layernorm.weight": init.norm(h, zero_centred=zero_centred),
        **_mlp(init, prefix, h, tc["intermediate_size"]),
    }


def _qwen35_layer(init: _Init, prefix: str, tc: dict, kind: str) -> dict[str, np.ndarray]:
    if kind == "linear_attention":
        mixer = _gated_delta_net(init, prefix, tc)
    else:
        mixer = _attention(init, prefix, tc, output_gate=True, zero_centred=True)
    return _decoder_layer(init, prefix, tc, mixer=mixer, zero_centred=True)


def _qwen35_tensors(seed: int, tc: dict, with_mtp: bool) -> dict[str, np.ndarray]:
    init = _Init(seed)
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    tensors = {f"{_TEXT}embed_tokens.weight": init.normal((vocab, h), 1.0)}
    for i, kind in enumerate(tc["layer_types"]):
        tensors |= _qwen35_layer(init, f"{_TEXT}layers.{i}.", tc, kind)
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
            tensors |= _qwen35_layer(init, f"mtp.layers.{j}.", tc, "full_attention")
        tensors["mtp.norm.weight"] = init.norm(h, zero_centred=True)
    return tensors


def _mrope_section(rotary_dim: int) -> list[int]:
    """Qwen's [11, 11, 10] split of rotary_dim / 2, scaled to this head size."""
    half = rotary_dim // 2
    side = round(half * 11 / 32)
    return [side, side, half - 2 * side]


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
) -> Path:
    """Write a random Qwen3.5 hybrid (GatedDeltaNet + gated attention) to dest.

    The layout is Qwen's published one: nested config.json, tensors under
    `model.language_model.`, top-level `lm_head` and `mtp.*`, zero-centred
    norms, HF conv1d layout. `with_mtp=False` keeps `mtp_num_hidden_layers` in
    the config but writes no `mtp.*` tensors, as some conversions do.
    `dtype` is float32, float16 or bfloat16. Deterministic in `seed`.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    specials = special_token_ids(vocab_size)
    partial_rotary_factor = 0.25
    text_config = {
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
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": dtype,
        "text_config": text_config,
        "tie_word_embeddings": False,
    }
    _write_json(dest / "config.json", config)
    _write_generation_config(dest, vocab_size)
    _save_safetensors(dest, _qwen35_tensors(seed, text_config, with_mtp), dtype)
    if tokenizer:
        build_tokenizer(dest, vocab_size=vocab_size)
    return dest


def _qwen3_tensors(seed: int, cfg: dict) -> dict[str, np.ndarray]:
    init = _Init(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    tied = cfg["tie_word_embeddings"]
    # Tied, the embedding is also the output head: scale it for logits of std ~3.
    tensors = {"model.embed_tokens.weight": init.normal((vocab, h), 3 / np.sqrt(h) if tied else 1)}
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        mixer = _attention(init, prefix, cfg, output_gate=False, zero_centred=False)
        tensors |= _decoder_layer(init, prefix, cfg, mixer=mixer, zero_centred=False)
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
    _write_json(dest / "config.json", config)
    _write_generation_config(dest, vocab_size)
    _save_safetensors(dest, _qwen3_tensors(seed, config), dtype)
    if tokenizer:
        build_tokenizer(dest, vocab_size=vocab_size)
    return dest


def _write_generation_config(dest: Path, vocab_size: int) -> None:
    # Qwen's: generation stops at <|im_end|> or <|endoftext|>.
    specials = special_token_ids(vocab_size)
    _write_json(
        dest / "generation_config.json",
        {
            "bos_token_id": specials[ENDOFTEXT],
            "eos_token_id": [specials[IM_END], specials[ENDOFTEXT]],
            "pad_token_id": specials[ENDOFTEXT],
        },
    )


def _save_safetensors(dest: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """model.safetensors plus the index that sharded releases carry."""
    import mlx.core as mx  # numpy has no bfloat16; mlx writes all three dtypes

    mx_dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    arrays = {name: mx.array(value).astype(mx_dtype) for name, value in tensors.items()}
    mx.save_safetensors(str(dest / "model.safetensors"), arrays, metadata={"format": "pt"})
    _write_json(
        dest / "model.safetensors.index.json",
        {
            "metadata": {"total_size": sum(a.nbytes for a in arrays.values())},
            "weight_map": {name: "model.safetensors" for name in sorted(arrays)},
        },
    )


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
