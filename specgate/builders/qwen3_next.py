"""Tiny Qwen3-Next (Qwen3NextForCausalLM) checkpoints in Qwen's published layout.

Qwen3-Next is the Qwen3.5 hybrid's predecessor with three differences on
disk: a flat config.json (no text_config) and tensors under `model.`; the
GatedDeltaNet's input projections fused, per key-head group, into
`in_proj_qkvz` and `in_proj_ba`; and MoE experts stored one module per
expert (mlx-lm's qwen3_next sanitize stacks `experts.{e}.*`). Norms are
zero-centred as in Qwen3.5, the MTP head is the same `mtp.*` block with an
MoE MLP, and vLLM loads it as Qwen3NextMTP.

Which config key declares the MTP layers is not settled by any source we
could read. vLLM reads `num_nextn_predict_layers` (Qwen3NextMultiTokenPredictor
defaults it to 1; the speculative config passes it on as n_predict); SGLang
sets `num_nextn_predict_layers = 1` on the draft config itself; transformers'
Qwen3NextConfig has no MTP field at all; and transcribed Qwen3-Next config
files carry neither `num_nextn_predict_layers` nor `mtp_num_hidden_layers`.
So by default the config declares nothing, as the releases appear to, and a
reader must find the head by its `mtp.*` tensors. `mtp_config_keys` writes
either or both keys for tests of readers that honour them.
"""

from __future__ import annotations

from pathlib import Path

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
from .tokenizer import ENDOFTEXT, IM_END, build_tokenizer, special_token_ids

MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def _fuse_gdn_projections(t: Tensors, prefix: str, cfg: dict) -> Tensors:
    """Qwen3.5's separate in_proj_{qkv,z,b,a} regrouped as Qwen3-Next's fused pair.

    Rows are grouped by key head: for each of the n_k groups, in_proj_qkvz
    holds [q (d_k) | k (d_k) | v (n_v/n_k * d_v) | z (same)] and in_proj_ba
    holds [b (n_v/n_k) | a (n_v/n_k)], which is the order mlx-lm's
    `fix_query_key_value_ordering` (and HF's) splits them back in.
    """
    p = f"{prefix}linear_attn."
    h, n_k = cfg["hidden_size"], cfg["linear_num_key_heads"]
    key_dim = n_k * cfg["linear_key_head_dim"]
    qkv = t.pop(f"{p}in_proj_qkv.weight")
    q, k, v = qkv[:key_dim], qkv[key_dim : 2 * key_dim], qkv[2 * key_dim :]
    z = t.pop(f"{p}in_proj_z.weight")
    b, a = t.pop(f"{p}in_proj_b.weight"), t.pop(f"{p}in_proj_a.weight")

    def grouped(*parts: np.ndarray) -> np.ndarray:
        return np.concatenate([x.reshape(n_k, -1, h) for x in parts], axis=1).reshape(-1, h)

    return {
        f"{p}in_proj_qkvz.weight": grouped(q, k, v, z),
        f"{p}in_proj_ba.weight": grouped(b, a),
        **t,
    }


def _layer(init: _Init, prefix: str, cfg: dict, *, linear: bool) -> Tensors:
    if linear:
        mixer = _fuse_gdn_projections(gated_delta_net(init, prefix, cfg), prefix, cfg)
    else:
        mixer = attention(init, prefix, cfg, output_gate=True, zero_centred=True)

    def ffn() -> Tensors:
        return sparse_moe(init, prefix, cfg, fused_experts=False)

    return decoder_layer(init, prefix, cfg, mixer=mixer, zero_centred=True, ffn=ffn)


def _tensors(seed: int, cfg: dict, num_mtp_layers: int) -> Tensors:
    init = _Init(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    interval = cfg["full_attention_interval"]
    tensors = {"model.embed_tokens.weight": init.normal((vocab, h), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        linear = (i + 1) % interval != 0
        tensors |= _layer(init, f"model.layers.{i}.", cfg, linear=linear)
    tensors["model.norm.weight"] = init.norm(h, zero_centred=True)
    tensors["lm_head.weight"] = init.linear(vocab, h, gain=3.0)  # logits of std ~3
    if num_mtp_layers > 0:
        # Same block as Qwen3.5's; its layer is full attention with an MoE MLP.
        tensors |= {
            "mtp.pre_fc_norm_embedding.weight": init.norm(h, zero_centred=True),
            "mtp.pre_fc_norm_hidden.weight": init.norm(h, zero_centred=True),
            "mtp.fc.weight": init.linear(h, 2 * h),  # input is [embedding, hidden]
        }
        for j in range(num_mtp_layers):
            tensors |= _layer(init, f"mtp.layers.{j}.", cfg, linear=False)
        tensors["mtp.norm.weight"] = init.norm(h, zero_centred=True)
    return tensors


def build_qwen3_next(
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
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 64,
    num_mtp_layers: int = 1,
    mtp_config_keys: tuple[str, ...] = (),
    max_position_embeddings: int = 8192,
    dtype: str = "float32",
    tokenizer: bool = True,
) -> Path:
    """Write a random Qwen3-Next model (hybrid GDN + gated attention, all-MoE) to dest.

    `num_mtp_layers` is how many `mtp.layers.*` to write (0: none).
    `mtp_config_keys` names the config keys, from MTP_CONFIG_KEYS, that
    declare them; the default declares nothing (see the module docstring).
    `intermediate_size` is written, as Qwen does, but unused: every layer is MoE.
    """
    unknown = set(mtp_config_keys) - set(MTP_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"mtp_config_keys must be among {MTP_CONFIG_KEYS}, got {sorted(unknown)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    specials = special_token_ids(vocab_size)
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": specials[ENDOFTEXT],
        "decoder_sparse_step": 1,
        "dtype": dtype,
        "eos_token_id": specials[IM_END],
        "full_attention_interval": full_attention_interval,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_value_head_dim": linear_value_head_dim,
        "max_position_embeddings": max_position_embeddings,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": num_attention_heads,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "output_router_logits": False,
        # Plain 1-D RoPE on a quarter of each head (no mRoPE: text only).
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10_000_000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    config |= dict.fromkeys(mtp_config_keys, num_mtp_layers)
    write_json(dest / "config.json", dict(sorted(config.items())))
    write_generation_config(dest, vocab_size)
    save_safetensors(dest, _tensors(seed, config, num_mtp_layers), dtype)
    if tokenizer:
        build_tokenizer(dest, vocab_size=vocab_size)
    return dest
