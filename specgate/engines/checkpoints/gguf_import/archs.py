"""GGUF architectures as the Hugging Face layout mlx-lm's model files read:
one record per family, its tensor names and its config.json.

Checked against mlx-lm 0.32.2's models/{llama,qwen2,qwen3,gemma3_text}.py
(their ModelArgs and module names) and against what llama.cpp's
convert_hf_to_gguf.py does to each family's tensors, which the import undoes:
Llama's Q/K rows were permuted for llama.cpp's interleaved RoPE, Llama-3's
RoPE scaling became a `rope_freqs` tensor of factors (checked against the
published scaling and written back as it), Gemma's norm weights were stored
as 1 + w (its RMSNorm multiplies by 1 + w).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# GGUF block tensor -> the mlx-lm module (under model.layers.N.).
_ATTN = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Outside the blocks, the same for every family here.
GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class Meta:
    """The architecture's keys (`<arch>.` stripped) with the few tensor
    facts a config needs."""

    def __init__(self, kv: dict, vocab_size: int, tensor_names: set[str], rope_freqs=None):
        self.kv, self.vocab_size, self.tensor_names = kv, vocab_size, tensor_names
        # Llama-3's RoPE scaling as llama.cpp keeps it: the factors each
        # frequency's period is multiplied by (None: not read, as inspect's).
        self.rope_freqs = rope_freqs

    def get(self, key: str, default=None):
        v = self.kv.get(key)
        return default if v is None else v

    def require(self, key: str):
        v = self.kv.get(key)
        if v is None:
            raise KeyError(key)
        return v

    @property
    def head_dim(self) -> int:
        return int(self.get("attention.key_length")
                   or self.require("embedding_length") // self.require("attention.head_count"))  # fmt: skip


@dataclass(frozen=True)
class Arch:
    gguf: str  # general.architecture
    model_type: str  # config.json's, the mlx-lm module that reads it
    block_tensors: dict[str, str]  # GGUF block tensor stem -> mlx-lm module path
    permute_qk: bool = False  # undo the Llama converter's Q/K row permutation
    norm_shift: float = 0.0  # subtracted from every *norm weight (Gemma: 1)
    extra_config: Callable[[Meta], dict] = field(default=lambda m: {})
    default_rope_theta: float = 10000.0
    # mlx-lm's model derives head_dim as hidden_size / heads (qwen2 takes no head_dim).
    derived_head_dim: bool = False


def _gemma3(m: Meta) -> dict:
    heads = m.require("attention.head_count")
    hidden = m.require("embedding_length")
    # llama.cpp's gemma3 attention scale: 1/sqrt(head_dim), but 27B's (62
    # blocks) is 1/sqrt(hidden / heads), as its query_pre_attn_scalar says.
    scalar = hidden // heads if m.require("block_count") == 62 else m.head_dim
    return {
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(m.get("attention.sliding_window", 4096)),
        # llama.cpp hard-codes gemma3's pattern (5 local layers, then 1
        # global) and local RoPE base; newer files may carry the pattern.
        "sliding_window_pattern": _pattern(m.get("attention.sliding_window_pattern"), 6),
        "rope_local_base_freq": 10000.0,
    }


def _pattern(value, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, int):
        return value
    # A per-layer list of booleans (sliding or not): the period of a global layer.
    flags = list(value)
    return flags.index(False) + 1 if False in flags else default


ARCHS = {
    a.gguf: a
    for a in (
        Arch("llama", "llama", {**_ATTN, **_MLP, **_LLAMA_NORMS}, permute_qk=True),
        Arch("qwen2", "qwen2", {**_ATTN, **_MLP, **_LLAMA_NORMS}, default_rope_theta=1e6,
             derived_head_dim=True),
        Arch("qwen3", "qwen3", {**_ATTN, **_MLP, **_LLAMA_NORMS, **_QK_NORMS}, default_rope_theta=1e6),
        Arch("gemma3", "gemma3_text", {**_ATTN, **_MLP, **_GEMMA_NORMS, **_QK_NORMS}, norm_shift=1.0,
             extra_config=_gemma3, default_rope_theta=1e6),
    )
}


def hf_name(arch: Arch, gguf_name: str) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor; None: the family has no such tensor."""
    stem, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.block_tensors:
        return f"model.layers.{parts[1]}.{arch.block_tensors[parts[2]]}.{kind}"
    return None


# Llama-3.x's published RoPE scaling besides its factor (every 3.1/3.2/3.3
# config has these); llama.cpp's file keeps only the factors they produce.
_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factors(base: float, dims: int, factor: float, low_freq_factor: float,
                   high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:  # fmt: skip
    """rope_freqs as llama.cpp's converter computes it (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
    wavelen = 2 * np.pi / freqs
    old = original_max_position_embeddings
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high_freq_factor, 1.0,
                    np.where(wavelen > old / low_freq_factor, factor, mid)).astype(np.float32)  # fmt: skip


def _llama3_scaling(m: Meta) -> dict:
    if m.rope_freqs is None:  # not read: judged when the import runs
        return {"rope_type": "llama3", "factor": 1.0, **_LLAMA3}
    factors = np.asarray(m.rope_freqs, np.float32)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3}
    want = llama3_factors(float(m.get("rope.freq_base", 10000.0)), m.head_dim,
                          **{k: v for k, v in scaling.items() if k != "rope_type"})  # fmt: skip
    if want.shape != factors.shape or not np.allclose(want, factors, rtol=1e-5, atol=1e-6):
        raise ValueError("rope_freqs factors other than Llama-3's scaling (low 1, high 4, 8192 tokens)")
    return scaling


def rope_scaling(m: Meta) -> dict | None:
    if "rope_freqs.weight" in m.tensor_names:
        return _llama3_scaling(m)
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(m.require("rope.scaling.factor"))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        return {"type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(m.require("rope.scaling.original_context_length"))}  # fmt: skip
    raise ValueError(f"RoPE scaling {kind!r}")


def config_json(arch: Arch, m: Meta, tied: bool) -> dict:
    """config.json as mlx-lm's model file for `arch` reads it."""
    config = {
        "model_type": arch.model_type,
        "hidden_size": int(m.require("embedding_length")),
        "num_hidden_layers": int(m.require("block_count")),
        "intermediate_size": int(m.require("feed_forward_length")),
        "num_attention_heads": int(m.require("attention.head_count")),
        "num_key_value_heads": int(m.get("attention.head_count_kv", m.require("attention.head_count"))),
        "head_dim": m.head_dim,
        "rms_norm_eps": float(m.require("attention.layer_norm_rms_epsilon")),
        "vocab_size": m.vocab_size,
        "max_position_embeddings": int(m.require("context_length")),
        "rope_theta": float(m.get("rope.freq_base", arch.default_rope_theta)),
        "rope_scaling": rope_scaling(m),
        "tie_word_embeddings": tied,
    }
    config.update(arch.extra_config(m))
    return config
