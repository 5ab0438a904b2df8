"""Export a Hugging Face Qwen3.5 hybrid checkpoint, MTP head included, to GGUF.

The output is meant for llama.cpp's `llama-server --spec-type draft-mtp`: the
trunk as architecture `qwen35` and the checkpoint's `mtp.*` head as one extra
block, `blk.{n_layer}`, carrying the `nextn.*` tensors. It is written with the
`gguf` package's GGUFWriter; no llama.cpp code is used or imported.

Every rule below was read from llama.cpp's own sources: the tree vendored in
llama-cpp-python 0.3.36 (llama.cpp b11312, the build the llamacpp backend
targets, see shared/reference/llamacpp-route.md) and the search index's newer
copies of ggml-org/llama.cpp, which agree on every point used here:

  [conv]    conversion/qwen.py: `Qwen3NextModel.modify_tensors` (A_log, dt_bias,
            conv1d, norm +1), `_LinearAttentionVReorderBase` (V-head order),
            `_QwenMtpMixin` (b11312; `_Qwen35MtpMixin` in newer trees):
            mtp.* -> layer n_layer, the nextn key,
            `_Qwen35MRopeMixin` (rope sections always written),
            `Qwen3NextModel.set_gguf_parameters` (ssm.* keys, rope dims).
  [base]    conversion/base.py: `TextModel.set_gguf_parameters` (generic keys),
            `ModelBase.filter_tensors` (drops `language_model.`),
            `ModelBase.prepare_tensors` (which tensors stay F32),
            `TextModel.get_vocab_base` (token list and types).
  [map]     gguf-py/gguf/tensor_mapping.py and constants.py: HF name -> GGUF
            name for the qwen35 tensor list (`post_attention_layernorm` is
            `post_attention_norm` there, not `ffn_norm`).
  [loader]  src/models/qwen35.cpp: `load_arch_hparams`, `load_arch_tensors`
            (required keys, tensor names and ggml shapes), `graph_mtp`;
            src/llama-model.cpp reads `{arch}.nextn_predict_layers`.
  [vocab]   src/llama-vocab.cpp: the `qwen35` and `qwen2` pre-tokenizer regexes.

The installed gguf 0.19 knows the `qwen35` architecture and every tensor name
used here (including `blk.{bid}.nextn.*` in TENSOR_NAMES), but its
MODEL_TENSORS[QWEN35] list omits the NEXTN entries that llama.cpp's own
gguf-py lists ("preserved but unused"). We never consult that list (no
TensorNameMap), so this does not matter.
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)
from gguf.constants import GGML_QUANT_VERSION

ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN35]  # "qwen35"

# --------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------


def _name(tensor: MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight") -> str:
    base = TENSOR_NAMES[tensor]
    return (base.format(bid=bid) if "{bid}" in base else base) + suffix


# Top-level tensors, HF name (after `language_model.` is dropped) -> GGUF. [map]
_GLOBAL = {
    "model.embed_tokens.weight": _name(MODEL_TENSOR.TOKEN_EMBD),
    "model.norm.weight": _name(MODEL_TENSOR.OUTPUT_NORM),
    "lm_head.weight": _name(MODEL_TENSOR.OUTPUT),
}

# Per-layer tensors, HF suffix after `model.layers.{i}.` -> (tensor, suffix).
# The same table serves the MTP block's `mtp.layers.0.*`, which is a
# full-attention decoder layer ([conv] `_Qwen35MtpMixin` renames it to
# `model.layers.{n_layer}.*` and lets this mapping apply). [map] [loader]
_LAYER: dict[str, tuple[MODEL_TENSOR, str]] = {
    "input_layernorm.weight": (MODEL_TENSOR.ATTN_NORM, ".weight"),
    # qwen35 has no FFN_NORM; the pre-FFN norm is ATTN_POST_NORM. [map] [loader]
    "post_attention_layernorm.weight": (MODEL_TENSOR.ATTN_POST_NORM, ".weight"),
    "mlp.gate_proj.weight": (MODEL_TENSOR.FFN_GATE, ".weight"),
    "mlp.up_proj.weight": (MODEL_TENSOR.FFN_UP, ".weight"),
    "mlp.down_proj.weight": (MODEL_TENSOR.FFN_DOWN, ".weight"),
    # Gated full attention. q_proj stays as is: per head [query | gate], which
    # qwen35.cpp views with a stride of 2 * head_dim. [loader]
    "self_attn.q_proj.weight": (MODEL_TENSOR.ATTN_Q, ".weight"),
    "self_attn.k_proj.weight": (MODEL_TENSOR.ATTN_K, ".weight"),
    "self_attn.v_proj.weight": (MODEL_TENSOR.ATTN_V, ".weight"),
    "self_attn.o_proj.weight": (MODEL_TENSOR.ATTN_OUT, ".weight"),
    "self_attn.q_norm.weight": (MODEL_TENSOR.ATTN_Q_NORM, ".weight"),
    "self_attn.k_norm.weight": (MODEL_TENSOR.ATTN_K_NORM, ".weight"),
    # Gated DeltaNet (linear attention). [map] [loader]
    "linear_attn.in_proj_qkv.weight": (MODEL_TENSOR.ATTN_QKV, ".weight"),
    "linear_attn.in_proj_z.weight": (MODEL_TENSOR.ATTN_GATE, ".weight"),
    "linear_attn.in_proj_b.weight": (MODEL_TENSOR.SSM_BETA, ".weight"),
    "linear_attn.in_proj_a.weight": (MODEL_TENSOR.SSM_ALPHA, ".weight"),
    "linear_attn.conv1d.weight": (MODEL_TENSOR.SSM_CONV1D, ".weight"),
    # dt_bias is a bias of the (absent) dt projection: `ssm_dt.bias`. [conv]
    "linear_attn.dt_bias": (MODEL_TENSOR.SSM_DT, ".bias"),
    # llama.cpp names it `blk.N.ssm_a`, no suffix (LLM_TENSOR_SSM_A_NOSCAN). [loader]
    "linear_attn.A_log": (MODEL_TENSOR.SSM_A, ""),
    "linear_attn.norm.weight": (MODEL_TENSOR.SSM_NORM, ".weight"),
    "linear_attn.out_proj.weight": (MODEL_TENSOR.SSM_OUT, ".weight"),
}

# MTP-only tensors, `mtp.{name}` -> tensor of block n_layer. [conv] `_Qwen35MtpMixin`
# remapper: fc -> eh_proj, pre_fc_norm_embedding -> enorm,
# pre_fc_norm_hidden -> hnorm, norm -> shared_head.norm.
_MTP: dict[str, MODEL_TENSOR] = {
    "fc.weight": MODEL_TENSOR.NEXTN_EH_PROJ,
    "pre_fc_norm_embedding.weight": MODEL_TENSOR.NEXTN_ENORM,
    "pre_fc_norm_hidden.weight": MODEL_TENSOR.NEXTN_HNORM,
    "norm.weight": MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}

# --------------------------------------------------------------------------
# Tensor transforms
# --------------------------------------------------------------------------


def _plus_one(w: np.ndarray) -> np.ndarray:
    # Qwen3.5's RMSNorms are zero-centred (scale = 1 + w); llama.cpp's
    # build_norm multiplies by the stored weight, so the file holds 1 + w. [conv]
    # The GDN gated norm (linear_attn.norm) stores its scale directly and is
    # exempt (`not name.endswith("linear_attn.norm.weight")`).
    return w + np.float32(1.0)


def _neg_exp(a_log: np.ndarray) -> np.ndarray:
    # qwen35.cpp multiplies softplus(alpha + dt_bias) by ssm_a directly, so the
    # file holds A = -exp(A_log), not A_log. [conv] [loader]
    return -np.exp(a_log)


def _squeeze_conv(w: np.ndarray) -> np.ndarray:
    # HF Conv1d weight is [channels, 1, kernel]; llama.cpp wants ggml
    # {kernel, channels}, i.e. numpy [channels, kernel]. [conv] [loader]
    return w.reshape(w.shape[0], w.shape[-1])


def _tile_v_heads(t: np.ndarray, axis: int, n_k: int, n_v: int, head_dim: int) -> np.ndarray:
    """Reorder V heads along `axis` from grouped-by-K-head to tiled order.

    HF's GDN gives value head j the key head j // (n_v / n_k) (grouped:
    K0's heads, then K1's, ...). llama.cpp broadcasts the key heads with
    ggml_repeat, which tiles (K0, K1, K0, K1, ...), so the converter reorders
    every V-indexed axis to [G0v0, G1v0, ..., G0v1, G1v1, ...]. [conv]
    `_LinearAttentionVReorderBase._reorder_v_heads`. No-op when n_k == n_v.
    """
    if n_k == n_v:
        return t
    axis %= t.ndim
    shape = t.shape
    split = shape[:axis] + (n_k, n_v // n_k, head_dim) + shape[axis + 1 :]
    return np.swapaxes(t.reshape(split), axis, axis + 1).reshape(shape)


@dataclass(frozen=True)
class _Gdn:
    """The GDN head layout, for the V-head reorder."""

    n_k: int
    n_v: int
    k_dim: int
    v_dim: int

    def reorder(self, suffix: str, t: np.ndarray) -> np.ndarray:
        """Apply the V-head reorder to the tensors that carry V heads. [conv]"""
        kv = 2 * self.n_k * self.k_dim  # q and k channels come first, untouched
        if suffix == "linear_attn.in_proj_qkv.weight":
            return np.concatenate([t[:kv], self._v(t[kv:], 0, self.v_dim)], axis=0)
        if suffix == "linear_attn.conv1d.weight":
            return np.concatenate([t[:kv], self._v(t[kv:], 0, self.v_dim)], axis=0)
        if suffix == "linear_attn.in_proj_z.weight":
            return self._v(t, 0, self.v_dim)
        if suffix in (
            "linear_attn.in_proj_a.weight",
            "linear_attn.in_proj_b.weight",
            "linear_attn.A_log",
            "linear_attn.dt_bias",
        ):
            return self._v(t, 0, 1)
        if suffix == "linear_attn.out_proj.weight":
            return self._v(t, 1, self.v_dim)  # columns: the input dimension
        return t

    def _v(self, t: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        return _tile_v_heads(t, axis, self.n_k, self.n_v, head_dim)


def _transform(suffix: str, t: np.ndarray, gdn: _Gdn) -> np.ndarray:
    """HF layer tensor -> the values llama.cpp expects (suffix as in _LAYER)."""
    t = gdn.reorder(suffix, t)
    if suffix == "linear_attn.A_log":
        return _neg_exp(t)
    if suffix == "linear_attn.conv1d.weight":
        return _squeeze_conv(t)
    if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":
        return _plus_one(t)
    return t


# --------------------------------------------------------------------------
# Safetensors reading (numpy has no bfloat16, so bf16 is widened by hand)
# --------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float32 numpy arrays."""
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        n = int.from_bytes(mm[:8], "little")
        header = json.loads(mm[8 : 8 + n])
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            raw = mm[base + start : base + end]
            shape = tuple(info["shape"])
            dtype = info["dtype"]
            if dtype == "BF16":
                bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
                arr = bits.view(np.float32)
            elif dtype in _ST_DTYPES:
                arr = np.frombuffer(raw, dtype=np.dtype(_ST_DTYPES[dtype]).newbyteorder("<"))
            else:
                raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
            out[name] = arr.astype(np.float32).reshape(shape)
    return out


def _load_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {hf_dir}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors |= _read_safetensors(hf_dir / name)
    return tensors


def _canonical(name: str) -> str | None:
    """HF tensor name -> `model.*`, `lm_head.*` or `mtp.*`; None to drop it."""
    # Vision tower and projector: not part of the text model. [base]
    if name.startswith(("model.visual.", "visual.")):
        return None
    # [base] ModelBase.filter_tensors drops `language_model.`; [conv] the
    # MTP mixin turns `model.mtp.` into `mtp.`.
    name = name.replace("language_model.", "", 1)
    if name.startswith("model.mtp."):
        name = name[len("model.") :]
    return name


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    raw: dict  # text config merged over the top level, as the converter does [base]
    n_layer: int
    n_mtp: int
    hidden: int
    head_dim: int
    gdn: _Gdn

    @classmethod
    def load(cls, hf_dir: Path) -> _Config:
        top = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
        cfg = {**top, **top.get("text_config", {})}
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise ValueError("Qwen3.5 MoE (qwen35moe) is not supported by this exporter")
        if cfg.get("model_type") not in ("qwen3_5", "qwen3_5_text"):
            raise ValueError(f"not a Qwen3.5 checkpoint: model_type={cfg.get('model_type')!r}")
        if cfg["linear_key_head_dim"] != cfg["linear_value_head_dim"]:
            # qwen35.cpp derives both head sizes from ssm.state_size. [loader]
            raise ValueError(
                "llama.cpp's qwen35 needs linear_key_head_dim == linear_value_head_dim"
            )
        hidden = cfg["hidden_size"]
        return cls(
            raw=cfg,
            n_layer=cfg["num_hidden_layers"],
            n_mtp=cfg.get("mtp_num_hidden_layers", 0),
            hidden=hidden,
            head_dim=cfg.get("head_dim") or hidden // cfg["num_attention_heads"],
            gdn=_Gdn(
                n_k=cfg["linear_num_key_heads"],
                n_v=cfg["linear_num_value_heads"],
                k_dim=cfg["linear_key_head_dim"],
                v_dim=cfg["linear_value_head_dim"],
            ),
        )

    @property
    def full_attention_interval(self) -> int:
        interval = self.raw.get("full_attention_interval", 4)
        # The loader takes layer kinds from an optional
        # `qwen35.attention.recurrent_layers` array, which the converter never
        # writes (nor do we: gguf 0.19 has no key for it), else from the
        # interval: (i + 1) % interval != 0 -> recurrent. [loader] So the
        # config's layer_types must follow the interval.
        if (kinds := self.raw.get("layer_types")) is not None:
            derived = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(self.n_layer)
            ]
            if list(kinds) != derived:
                raise ValueError(
                    "layer_types do not follow full_attention_interval; "
                    "llama.cpp's qwen35 loader could not represent them"
                )
        return interval

    @property
    def rope(self) -> dict:
        return self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {}

    @property
    def partial_rotary_factor(self) -> float:
        return self.raw.get("partial_rotary_factor", self.rope.get("partial_rotary_factor", 0.25))


# --------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------


def _write_hparams(w: GGUFWriter, cfg: _Config, block_count: int, n_nextn: int, ftype: int) -> None:
    c = cfg.raw
    # Generic keys. [base] TextModel.set_gguf_parameters
    w.add_block_count(block_count)  # trunk + MTP block(s) [conv]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if (theta := cfg.rope.get("rope_theta", c.get("rope_theta"))) is not None:
        w.add_rope_freq_base(float(theta))
    # Required by the qwen35 loader; [11, 11, 10, 0] when the config lacks it.
    # [conv] _Qwen35MRopeMixin, [base] pads to 4, [loader] get_key_or_arr(.., 4, true)
    sections = list(cfg.rope.get("mrope_section", [11, 11, 10]))
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
    # Partial rotary: only head_dim * factor dims are rotated. [conv]
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.partial_rotary_factor))
    # Gated DeltaNet. [conv] Qwen3NextModel.set_gguf_parameters, [loader]
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg.gdn.k_dim)
    w.add_ssm_group_count(cfg.gdn.n_k)
    w.add_ssm_time_step_rank(cfg.gdn.n_v)
    w.add_ssm_inner_size(cfg.gdn.v_dim * cfg.gdn.n_v)
    w.add_full_attention_interval(cfg.full_attention_interval)
    if n_nextn:
        w.add_nextn_predict_layers(n_nextn)  # [conv] _Qwen35MtpMixin
    w.add_file_type(ftype)
    w.add_quantization_version(GGML_QUANT_VERSION)


# Pre-tokenizer split regexes as they appear in tokenizer.json, keyed by the
# `tokenizer.ggml.pre` name whose llama.cpp regex is the same. [vocab] keeps
# the tokenizer.json form in a comment next to each rewritten C++ regex.
_PRE_TOKENIZERS = {
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _split_regex(pre: dict | None) -> str | None:
    """The Split regex of a tokenizer.json pre_tokenizer (None if there is none)."""
    if not pre:
        return None
    if pre.get("type") == "Sequence":
        for p in pre.get("pretokenizers", []):
            if (found := _split_regex(p)) is not None:
                return found
        return None
    if pre.get("type") == "Split":
        return pre.get("pattern", {}).get("Regex")
    return None


def _pre_tokenizer_name(tok: dict) -> str:
    """Choose `tokenizer.ggml.pre` by matching the split regex.

    llama.cpp's converter identifies the pre-tokenizer by hashing the ids a
    known tokenizer gives for a fixed text; a locally trained vocabulary never
    matches any hash, so we compare the regex itself instead (inferred to be
    equivalent: the hash exists only to recognise the regex).
    """
    regex = _split_regex(tok.get("pre_tokenizer"))
    for name, known in _PRE_TOKENIZERS.items():
        if regex == known:
            return name
    raise ValueError(f"unrecognised pre-tokenizer regex {regex!r}; llama.cpp would not match it")


def _merges(model: dict) -> list[str]:
    # tokenizers writes merges as "a b" strings (older) or [a, b] pairs (newer).
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _special_id(value: object, vocab: dict[str, int]) -> int | None:
    if isinstance(value, dict):  # AddedToken serialisation
        value = value.get("content")
    return vocab.get(value) if isinstance(value, str) else None


def _write_tokenizer(w: GGUFWriter, hf_dir: Path, cfg: _Config) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tcfg_path = hf_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers are supported, got {model.get('type')!r}")

    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    vocab |= {t["content"]: i for i, t in added.items()}
    n_vocab = max(cfg.raw["vocab_size"], max(vocab.values()) + 1)
    by_id = {i: t for t, i in vocab.items()}

    # [base] get_vocab_base: ids without a token become "[PAD{i}]" (UNUSED),
    # so the list is as long as the embedding; added tokens are CONTROL when
    # special (or look special, "<|...|>"), USER_DEFINED otherwise.
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            text = by_id[i]
            looks_special = text.startswith("<|") and text.endswith("|>")
            special = added[i].get("special") or looks_special
            tokens.append(text)
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)

    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_tokenizer_pre(_pre_tokenizer_name(tok))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(_merges(model))

    # Special ids: tokenizer_config first, then config.json / generation_config
    # (the order gguf's SpecialVocab uses; inferred from its behaviour, not
    # re-read for this export).
    gen_path = hf_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}

    def first_id(*values: object) -> int | None:
        for v in values:
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, int):
                return v
            if (found := _special_id(v, vocab)) is not None:
                return found
        return None

    bos = first_id(tcfg.get("bos_token"), cfg.raw.get("bos_token_id"), gen.get("bos_token_id"))
    eos = first_id(tcfg.get("eos_token"), cfg.raw.get("eos_token_id"), gen.get("eos_token_id"))
    pad = first_id(tcfg.get("pad_token"), cfg.raw.get("pad_token_id"), gen.get("pad_token_id"))
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if pad is not None:
        w.add_pad_token_id(pad)
    # Qwen never prepends BOS or appends EOS; published Qwen GGUFs carry
    # add_bos_token = false (inferred from those files, not from source).
    w.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    w.add_add_eos_token(bool(tcfg.get("add_eos_token", False)))

    template = tcfg.get("chat_template")
    jinja = hf_dir / "chat_template.jinja"  # newer transformers keep it apart
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template:
        w.add_chat_template(template)


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------


def _keep_f32(gguf_name: str, arr: np.ndarray) -> bool:
    # [base] prepare_tensors: 1-D tensors, norms, ssm_conv1d and anything not
    # named `.weight` (ssm_a, ssm_dt.bias) stay F32 whatever the outtype.
    return (
        arr.ndim <= 1
        or gguf_name.endswith("_norm.weight")
        or gguf_name.endswith(".ssm_conv1d.weight")
        or not gguf_name.endswith(".weight")
    )


def _file_order(gguf_name: str) -> tuple[int, str]:
    # token_embd, then blk.0 .. blk.N, then output_norm and output (cosmetic:
    # llama.cpp finds tensors by name).
    if gguf_name.startswith("blk."):
        return 1 + int(gguf_name.split(".")[1]), gguf_name
    return (0 if gguf_name.startswith("token_embd") else 1 << 20), gguf_name


_LAYER_RE = re.compile(r"^(model|mtp)\.layers\.(\d+)\.(.+)$")


def _plan(
    tensors: dict[str, np.ndarray], cfg: _Config, include_mtp: bool
) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(GGUF name, value) for every tensor to write, in a stable order."""
    for hf_name in sorted(tensors):
        name = _canonical(hf_name)
        if name is None:
            continue
        value = tensors[hf_name]
        if name in _GLOBAL:
            if name.endswith("norm.weight"):
                yield _GLOBAL[name], lambda v=value: _plus_one(v)  # output_norm [conv]
            else:
                yield _GLOBAL[name], lambda v=value: v
            continue
        if name.startswith("mtp.") and not include_mtp:
            continue
        if (m := _LAYER_RE.match(name)) is not None:
            kind, idx, suffix = m.group(1), int(m.group(2)), m.group(3)
            if suffix not in _LAYER:
                raise ValueError(f"unmapped layer tensor {hf_name}")
            bid = idx if kind == "model" else cfg.n_layer + idx
            tensor, ext = _LAYER[suffix]
            yield _name(tensor, bid, ext), lambda v=value, s=suffix: _transform(s, v, cfg.gdn)
            continue
        if name.startswith("mtp."):
            key = name[len("mtp.") :]
            if key not in _MTP:
                raise ValueError(f"unmapped MTP tensor {hf_name}")
            # The converter renames first (enorm, hnorm, shared_head.norm) and
            # then shifts every `*norm.weight`, so all three MTP norms get +1;
            # only eh_proj is copied as is. [conv]
            is_norm = _MTP[key] is not MODEL_TENSOR.NEXTN_EH_PROJ
            fn = _plus_one if is_norm else (lambda v: v)
            yield _name(_MTP[key], cfg.n_layer), lambda v=value, f=fn: f(v)
            continue
        raise ValueError(f"unmapped tensor {hf_name}")


def export_gguf(
    hf_dir: Path, out_path: Path, *, outtype: str = "f32", include_mtp: bool = True
) -> Path:
    """Write `hf_dir` (Qwen3.5 hybrid, HF layout) to the GGUF file `out_path`.

    outtype "f32" writes every tensor as F32; "f16" writes the matrices as F16
    and keeps norms, 1-D tensors and the conv kernel F32, as llama.cpp's
    converter does. With include_mtp the checkpoint's `mtp.*` head becomes
    block n_layer (`blk.{n_layer}.nextn.*` plus a full-attention layer) and
    `qwen35.nextn_predict_layers` is set; a checkpoint without `mtp.*`
    tensors then raises (pass include_mtp=False for a trunk-only file).
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype must be 'f32' or 'f16', not {outtype!r}")
    cfg = _Config.load(hf_dir)
    tensors = _load_tensors(hf_dir)

    has_mtp = any((_canonical(n) or "").startswith("mtp.") for n in tensors)
    n_nextn = 0
    if include_mtp:
        if not has_mtp or cfg.n_mtp < 1:
            raise ValueError(f"{hf_dir} has no MTP head (mtp.* tensors); use include_mtp=False")
        if cfg.n_mtp != 1:
            # qwen35.cpp graph_mtp asserts n_layer_nextn == 1. [loader]
            raise ValueError(f"llama.cpp's qwen35 supports one MTP block, config has {cfg.n_mtp}")
        n_nextn = cfg.n_mtp
    block_count = cfg.n_layer + n_nextn

    ftype = LlamaFileType.MOSTLY_F16 if outtype == "f16" else LlamaFileType.ALL_F32
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path=None, arch=ARCH)
    writer.add_type("model")
    writer.add_name(hf_dir.name)
    _write_hparams(writer, cfg, block_count, n_nextn, int(ftype))
    _write_tokenizer(writer, hf_dir, cfg)

    planned = dict(_plan(tensors, cfg, include_mtp))
    for gguf_name in sorted(planned, key=_file_order):
        arr = np.ascontiguousarray(planned[gguf_name](), dtype=np.float32)
        if outtype == "f16" and not _keep_f32(gguf_name, arr):
            arr = arr.astype(np.float16)
        writer.add_tensor(gguf_name, arr)

    writer.write_header_to_file(path=out_path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
