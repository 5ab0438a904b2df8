"""Shared pieces of the tiny-checkpoint builders: seeded tensors, blocks, files.

Every builder draws its tensors from one `_Init` in a fixed order, so a seed
fixes the bytes on disk. The block helpers return {name: array} dicts in the
names Hugging Face checkpoints use; the callers add the prefixes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

Tensors = dict[str, np.ndarray]


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
        # Qwen3, Gemma-4 and the GDN gated norm store the scale itself.
        w = self.normal((dim,), 0.1)
        return w if zero_centred else 1.0 + w


def glu(init: _Init, prefix: str, hidden: int, inter: int) -> Tensors:
    """A SwiGLU/GeGLU MLP: {prefix}{gate,up,down}_proj.weight."""
    return {
        f"{prefix}gate_proj.weight": init.linear(inter, hidden),
        f"{prefix}up_proj.weight": init.linear(inter, hidden),
        f"{prefix}down_proj.weight": init.linear(hidden, inter),
    }


def attention(
    init: _Init, prefix: str, tc: dict, *, output_gate: bool, zero_centred: bool
) -> Tensors:
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


def gated_delta_net(init: _Init, prefix: str, tc: dict) -> Tensors:
    """Qwen3.5's GatedDeltaNet with separate in_proj_{qkv,z,b,a} (Qwen3-Next fuses them)."""
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


def decoder_layer(
    init: _Init,
    prefix: str,
    tc: dict,
    *,
    mixer: Tensors,
    zero_centred: bool,
    ffn: Callable[[], Tensors] | None = None,
) -> Tensors:
    """Norms around a mixer (drawn by the caller) and a feed-forward block.

    `ffn` draws the feed-forward tensors after the norms; the default is the
    dense MLP of width `intermediate_size`.
    """
    h = tc["hidden_size"]
    tensors = {
        f"{prefix}input_layernorm.weight": init.norm(h, zero_centred=zero_centred),
        **mixer,
        f"{prefix}post_attention_layernorm.weight": init.norm(h, zero_centred=zero_centred),
    }
    if ffn is None:
        return tensors | glu(init, f"{prefix}mlp.", h, tc["intermediate_size"])
    return tensors | ffn()


def sparse_moe(init: _Init, prefix: str, tc: dict, *, fused_experts: bool) -> Tensors:
    """Qwen's MoE block: router `gate`, routed experts, gated shared expert.

    Fused, the experts are two 3-D tensors with no `.weight` suffix, gate rows
    before up rows: `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj
    [E, H, I]` (Qwen3.5/3.6 bf16 releases; mlx-lm's qwen3_5_moe sanitize splits
    gate_up at I). Per expert, `experts.{e}.{gate,up,down}_proj.weight`
    (Qwen3-Next; the Qwen3.5 MTP layer; re-saved derivatives).
    """
    h, n_e = tc["hidden_size"], tc["num_experts"]
    inter = tc["moe_intermediate_size"]
    p = f"{prefix}mlp."
    # Router gain 1: softmax over logits of std ~1 spreads tokens over experts.
    tensors = {f"{p}gate.weight": init.linear(n_e, h)}
    if fused_experts:
        tensors[f"{p}experts.gate_up_proj"] = init.normal((n_e, 2 * inter, h), 1 / np.sqrt(h))
        tensors[f"{p}experts.down_proj"] = init.normal((n_e, h, inter), 1 / np.sqrt(inter))
    else:
        for e in range(n_e):
            tensors |= glu(init, f"{p}experts.{e}.", h, inter)
    tensors |= glu(init, f"{p}shared_expert.", h, tc["shared_expert_intermediate_size"])
    tensors[f"{p}shared_expert_gate.weight"] = init.linear(1, h)
    return tensors


def zero_centred_norm(name: str) -> bool:
    """Whether a Qwen3.5/Qwen3-Next tensor is a zero-centred RMSNorm (scale 1 + w).

    mlx-lm's sanitize adds 1 to exactly these trunk norms, mlx-vlm's MTP split
    to the `mtp.*` ones; the GDN's gated `linear_attn.norm` stores its scale.
    """
    suffixes = (
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    )
    whole = (
        "model.language_model.norm.weight",
        "model.norm.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    )
    return name.endswith(suffixes) or name in whole


# --- files -------------------------------------------------------------------

_DTYPES = ("float32", "float16", "bfloat16")


def save_safetensors(dest: Path, tensors: Tensors, dtype: str) -> None:
    """model.safetensors plus the index that sharded releases carry.

    Floating tensors are stored in `dtype`; integer buffers (Gemma-4's
    token_ordering) keep their own type.
    """
    import mlx.core as mx  # numpy has no bfloat16; mlx writes all three dtypes

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    mx_dtype = getattr(mx, dtype)
    arrays = {
        name: mx.array(value)
        if np.issubdtype(value.dtype, np.integer)
        else mx.array(value).astype(mx_dtype)
        for name, value in tensors.items()
    }
    write_arrays(dest, {"model.safetensors": arrays})


def write_arrays(dest: Path, shards: dict[str, dict]) -> None:
    """Write mlx arrays as safetensors shards and the index naming them."""
    import mlx.core as mx

    weight_map, total = {}, 0
    for file_name, arrays in shards.items():
        # Write beside and rename: the trap helpers rewrite files they read from.
        tmp = dest / f".{file_name}.tmp.safetensors"
        mx.save_safetensors(str(tmp), arrays, metadata={"format": "pt"})
        tmp.replace(dest / file_name)
        weight_map |= dict.fromkeys(arrays, file_name)
        total += sum(a.nbytes for a in arrays.values())
    write_json(
        dest / "model.safetensors.index.json",
        {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        },
    )


def read_shards(path: Path) -> dict[str, dict]:
    """{shard file name: {tensor name: mlx array}} of a checkpoint, dtypes as stored."""
    import mlx.core as mx

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    shards = {name: mx.load(str(path / name)) for name in files}
    # mx.load maps lazily; materialise now, since callers may overwrite the files.
    mx.eval([a for arrays in shards.values() for a in arrays.values()])
    return shards


def read_tensors(path: Path, names: list[str]) -> Tensors:
    """The named tensors of a checkpoint as float32 numpy arrays."""
    import mlx.core as mx

    found = {}
    for arrays in read_shards(path).values():
        for name in names:
            if name in arrays:
                found[name] = np.array(arrays[name].astype(mx.float32))
    missing = [n for n in names if n not in found]
    if missing:
        raise KeyError(f"{path}: no tensors {missing}")
    return found


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def write_generation_config(dest: Path, vocab_size: int) -> None:
    """Qwen's: generation stops at <|im_end|> or <|endoftext|>."""
    from .tokenizer import ENDOFTEXT, IM_END, special_token_ids

    specials = special_token_ids(vocab_size)
    write_json(
        dest / "generation_config.json",
        {
            "bos_token_id": specials[ENDOFTEXT],
            "eos_token_id": [specials[IM_END], specials[ENDOFTEXT]],
            "pad_token_id": specials[ENDOFTEXT],
        },
    )
