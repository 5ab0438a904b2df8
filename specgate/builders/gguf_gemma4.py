"""Export a Hugging Face Gemma-4 target and its "-assistant" MTP drafter to GGUF.

Two files, as llama.cpp wants them: the target as architecture `gemma4`, the
assistant (Gemma4AssistantForCausalLM) as a separate model of architecture
`gemma4-assistant`, given to llama-server as the draft model:

    llama-server -m target.gguf -md assistant.gguf --spec-type draft-mtp

The assistant is not a `blk.{n_layer}.nextn.*` block of the target (that is
Qwen3.5's layout, gguf_export.py): it is its own file whose every block is an
MTP layer (`nextn_predict_layers == block_count`), and whose context borrows
the target's token embedding and K/V cache at run time (`ctx_other`). Written
with the `gguf` package's GGUFWriter; no llama.cpp code is used or imported.

Every rule below was read from the llama.cpp tree vendored in
llama-cpp-python 0.3.36 (llama.cpp b11312, the build the llamacpp backend
targets):

  [conv]    conversion/gemma.py: `Gemma4Model` (set_gguf_parameters: head
            widths, SWA pattern, rope dims; generate_extra_tensors: the
            proportional-rope `rope_freqs`; filter_tensors: `layer_scalar` ->
            `.weight`; modify_tensors: router.scale, per_expert_scale; no norm
            shift), `Gemma3Model.set_gguf_parameters` (softcap, sliding window,
            rope bases) and `Gemma4AssistantModel` (drops `masked_embedding.*`,
            adds embedding_length_out and nextn_predict_layers).
  [base]    conversion/base.py: `TextModel.set_gguf_parameters` (generic keys),
            `ModelBase.filter_tensors` (drops `language_model.`),
            `TextModel.filter_tensors` (drops vision / audio towers),
            `ModelBase.prepare_tensors` (which tensors stay F32).
  [map]     gguf-py/gguf/tensor_mapping.py and constants.py (MODEL_TENSORS
            for GEMMA4 / GEMMA4_ASSISTANT, TENSOR_NAMES); also
            src/llama-arch.cpp's LLM_TENSOR_NAMES, which agree.
  [loader]  src/models/gemma4.cpp and src/models/gemma4-assistant.cpp:
            load_arch_hparams (required keys), load_arch_tensors (names and
            ggml shapes) and the graphs; src/llama-model.cpp (generic keys,
            the assistant's KV sharing: its sliding layers read the target's
            layer n_layer-2, its full layers layer n_layer-1).

The installed gguf 0.19 knows `gemma4` but not `gemma4-assistant` nor the
`nextn.pre_projection` / `nextn.post_projection` names, so names are spelled
out here, from [map]. The tokenizer is written by gguf_export's
`_write_tokenizer` (a byte-level BPE, `gpt2` model): our tiny checkpoints
carry this repo's Qwen-style tokenizer, not Gemma's (whose converter writes a
`gemma4` tokenizer model and forces add_bos_token = true).
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_VERSION

from .gguf_export import _file_order, _write_tokenizer

ARCH = "gemma4"  # [map] MODEL_ARCH_NAMES[GEMMA4]
ASSISTANT_ARCH = "gemma4-assistant"  # [map] MODEL_ARCH_NAMES[GEMMA4_ASSISTANT]

# --------------------------------------------------------------------------
# Tensor names [map]
# --------------------------------------------------------------------------

# Top-level tensors of the target, HF name (after `language_model.` is
# dropped) -> GGUF. No lm_head in the tied releases: the loader falls back to
# token_embd for the output when `output.weight` is absent. [loader]
_TARGET_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    # Per-layer embeddings (E2B/E4B-like "small" variant).
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}

# Top-level tensors of the assistant. Its embedding is only its (tied) output
# head: the input embedding is the target's, read through ctx_other. [loader]
_ASSISTANT_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "pre_projection.weight": "nextn.pre_projection.weight",
    "post_projection.weight": "nextn.post_projection.weight",
}

# Per-layer tensors, HF suffix after `model.layers.{i}.` -> GGUF suffix after
# `blk.{i}.`. [map] [conv] (`layer_scalar` gets `.weight`; router.scale is
# the gate input's `.scale`, per_expert_scale the down experts' `.scale`).
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "layer_scalar": "layer_output_scale.weight",
    # MoE block (26B-A4B-like). HF's fused experts are [E, 2I, H] (gate then
    # up) and [E, H, I]: numpy order is already ggml's {H, 2I, E} / {I, H, E}.
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    # Per-layer input embeddings.
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
}

# The only per-layer tensors gemma4-assistant's loader creates: no K/V (every
# layer reads the target's cache), no k_norm, no MoE, no per-layer inputs.
# Any other tensor in the file would fail the loader's tensor count. [loader]
_ASSISTANT_LAYER = frozenset({
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "layer_scalar",
})  # fmt: skip

_ROPE_FREQS = "rope_freqs.weight"  # one tensor, shared by every full layer [loader]
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# --------------------------------------------------------------------------
# Safetensors reading (bf16 widened by hand; names filtered before decoding,
# so the assistant's int64 `token_ordering` is never read)
# --------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _read_safetensors(path: Path, keep: Callable[[str], bool]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        n = int.from_bytes(mm[:8], "little")
        header = json.loads(mm[8 : 8 + n])
        for name, info in header.items():
            if name == "__metadata__" or not keep(name):
                continue
            start, end = info["data_offsets"]
            raw = mm[8 + n + start : 8 + n + end]
            if info["dtype"] == "BF16":
                arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            elif info["dtype"] in _ST_DTYPES:
                arr = np.frombuffer(raw, dtype=np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<"))
            else:
                raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
            out[name] = arr.astype(np.float32).reshape(tuple(info["shape"]))
    return out


def _load_tensors(hf_dir: Path, keep: Callable[[str], bool]) -> dict[str, np.ndarray]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {hf_dir}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors |= _read_safetensors(hf_dir / name, keep)
    return tensors


def _is_multimodal(name: str) -> bool:
    # [base] TextModel.filter_tensors skips vision / audio towers and embedders.
    return any(s in name for s in ("vision.", "audio.", "vision_", "audio_"))


def _is_masked_embedding(name: str) -> bool:
    # [conv] Gemma4AssistantModel.filter_tensors: `masked_embedding` (the
    # centroid head's centroids and token_ordering) is never written.
    return "masked_embedding" in name


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    raw: dict  # text_config merged over the top level, as the converter does [base]
    n_layer: int
    swa: list[bool]  # per layer: sliding_attention?
    head_dim_full: int
    head_dim_swa: int

    @classmethod
    def load(cls, hf_dir: Path, model_types: tuple[str, ...]) -> _Config:
        top = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
        if top.get("model_type") not in model_types:
            raise ValueError(
                f"{hf_dir}: expected model_type in {model_types}, got {top.get('model_type')!r}"
            )
        c = {**top, **top.get("text_config", {})}
        kinds = c["layer_types"]
        if len(kinds) != c["num_hidden_layers"]:
            raise ValueError("layer_types must have num_hidden_layers entries")
        full = c.get("rope_parameters", {}).get("full_attention", {})
        # [conv] generate_extra_tensors asserts it; global_head_dim may also come
        # from per_layer_config, which no builder of ours writes.
        if full.get("rope_type") != "proportional":
            raise ValueError("llama.cpp's converter requires proportional rope on full layers")
        if c.get("global_head_dim") is None:
            raise ValueError("global_head_dim is required (per_layer_config is not supported)")
        return cls(
            raw=c,
            n_layer=c["num_hidden_layers"],
            swa=[k == "sliding_attention" for k in kinds],
            head_dim_full=int(c["global_head_dim"]),
            head_dim_swa=int(c["head_dim"]),
        )

    @property
    def rope_full(self) -> dict:
        return self.raw["rope_parameters"]["full_attention"]

    @property
    def rope_swa(self) -> dict:
        return self.raw["rope_parameters"].get("sliding_attention", {})


# --------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------


def _write_hparams(w: GGUFWriter, cfg: _Config, ftype: int) -> None:
    """The keys Gemma4Model's converter writes, each once. [base] [conv]"""
    c = cfg.raw
    w.add_block_count(cfg.n_layer)
    w.add_context_length(c.get("max_position_embeddings", 131072))
    w.add_embedding_length(c["hidden_size"])
    if c.get("use_double_wide_mlp"):
        # [conv] KV-shared layers have a twice-wide MLP.
        first_shared = cfg.n_layer - c["num_kv_shared_layers"]
        n_ff = c["intermediate_size"]
        w.add_feed_forward_length([n_ff if i < first_shared else 2 * n_ff for i in range(cfg.n_layer)])
    else:
        w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    # [conv] with num_global_key_value_heads, an array: full layers have their own count.
    n_kv_swa, n_kv_full = c["num_key_value_heads"], c.get("num_global_key_value_heads")
    if n_kv_full is not None:
        w.add_head_count_kv([n_kv_swa if s else n_kv_full for s in cfg.swa])
    else:
        w.add_head_count_kv(n_kv_swa)
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    # [base] rope_type "proportional" maps to no scaling type: nothing written.
    w.add_rope_freq_base(float(cfg.rope_full.get("rope_theta", 1_000_000.0)))
    if (theta_swa := cfg.rope_swa.get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(float(theta_swa))
    if softcap := c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(softcap))
    if c.get("sliding_window_pattern") != 1:  # [conv] Gemma3Model's condition
        w.add_sliding_window(c["sliding_window"])
    w.add_shared_kv_layers(c.get("num_kv_shared_layers", 0))
    w.add_embedding_length_per_layer_input(c.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(cfg.swa)  # a bool array: True = sliding layer
    # Full layers' head width is the key/value length; sliding layers' the _swa one.
    w.add_key_length(cfg.head_dim_full)
    w.add_value_length(cfg.head_dim_full)
    w.add_key_length_swa(cfg.head_dim_swa)
    w.add_value_length_swa(cfg.head_dim_swa)
    # MoE. [base] expert_count / expert_used_count, [conv] expert FFN length.
    if (n_ff_exp := c.get("expert_intermediate_size", c.get("moe_intermediate_size"))) is not None:
        w.add_expert_feed_forward_length(n_ff_exp)
    if (n_expert := c.get("num_experts")) is not None:
        w.add_expert_count(n_expert)
    if (n_used := c.get("top_k_experts")) is not None:
        w.add_expert_used_count(n_used)
    # [conv] Full layers rotate their whole head (the unrotated part is made
    # inert by rope_freqs); sliding layers by the top-level partial factor,
    # which the nested rope_parameters never carry, so 1.0.
    partial_swa = c["rope_parameters"].get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(cfg.head_dim_full)
    w.add_rope_dimension_count_swa(int(cfg.head_dim_swa * partial_swa))
    w.add_file_type(ftype)
    w.add_quantization_version(GGML_QUANT_VERSION)


def _rope_freqs(cfg: _Config) -> np.ndarray:
    """[conv] generate_extra_tensors: ggml's neox rope can only rotate a head's
    leading dims, so proportional rope (rotate head_dim * factor of them, with
    frequencies of the full width) is expressed as a full-width rotation whose
    unrotated pairs get a frequency factor of 1e30 (theta / 1e30 ~ 0)."""
    n_rot = int(cfg.head_dim_full * cfg.rope_full["partial_rotary_factor"] / 2)
    n_unrot = cfg.head_dim_full // 2 - n_rot
    return np.array([1.0] * n_rot + [1e30] * n_unrot, dtype=np.float32)


# --------------------------------------------------------------------------
# Tensor plans
# --------------------------------------------------------------------------


def _canonical(name: str) -> str:
    return name.replace("language_model.", "", 1)  # [base] ModelBase.filter_tensors


def _layer_name(hf_name: str, name: str, allowed: frozenset[str] | None) -> str:
    m = _LAYER_RE.match(name)
    if m is None:
        raise ValueError(f"unmapped tensor {hf_name}")
    bid, suffix = int(m.group(1)), m.group(2)
    if suffix not in _LAYER or (allowed is not None and suffix not in allowed):
        raise ValueError(f"unmapped layer tensor {hf_name}")
    return f"blk.{bid}.{_LAYER[suffix]}"


def _plan(
    tensors: dict[str, np.ndarray], cfg: _Config, globals_: dict[str, str],
    allowed: frozenset[str] | None,
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, value) for every tensor; values are copied as stored:
    Gemma-4's RMSNorms scale by the weight itself, so no +1 shift. [conv]"""
    for hf_name in sorted(tensors):
        name = _canonical(hf_name)
        if name in globals_:
            yield globals_[name], tensors[hf_name]
        else:
            yield _layer_name(hf_name, name, allowed), tensors[hf_name]
    if not all(cfg.swa):
        yield _ROPE_FREQS, _rope_freqs(cfg)


def _keep_f32(gguf_name: str, arr: np.ndarray) -> bool:
    # [base] prepare_tensors: 1-D tensors, `*_norm.weight` and the MoE gate
    # input stay F32 whatever the outtype.
    return arr.ndim <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.endswith(
        ".ffn_gate_inp.weight"
    )


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _TokenizerConfig:
    raw: dict  # what gguf_export._write_tokenizer reads: vocab_size and the special ids


def _ftype(outtype: str) -> LlamaFileType:
    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype must be 'f32' or 'f16', not {outtype!r}")
    return LlamaFileType.MOSTLY_F16 if outtype == "f16" else LlamaFileType.ALL_F32


def _tokenizer_config(tok_dir: Path, vocab_size: int) -> _TokenizerConfig:
    if not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {tok_dir}; pass tokenizer_dir (the target's directory)"
        )
    top = json.loads((tok_dir / "config.json").read_text(encoding="utf-8"))
    return _TokenizerConfig(raw={**top, **top.get("text_config", {}), "vocab_size": vocab_size})


def _write(
    out_path: Path, arch: str, name: str, cfg: _Config, tok_dir: Path, outtype: str,
    planned: dict[str, np.ndarray], extra: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    ftype = _ftype(outtype)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path=None, arch=arch)
    writer.add_type("model")
    writer.add_name(name)
    _write_hparams(writer, cfg, int(ftype))
    if extra is not None:
        extra(writer)
    tok_cfg = _tokenizer_config(tok_dir, cfg.raw["vocab_size"])
    _write_tokenizer(writer, tok_dir, tok_cfg)  # type: ignore[arg-type]  # reads .raw only
    n_tokens = len(writer.kv_data[0]["tokenizer.ggml.tokens"].value)
    if (rows := planned["token_embd.weight"].shape[0]) != n_tokens:
        # [loader] token_embd is {n_embd, n_vocab}, n_vocab the token list's length.
        raise ValueError(f"embedding has {rows} rows but the tokenizer {n_tokens} tokens")
    for gguf_name in sorted(planned, key=_file_order):
        arr = np.ascontiguousarray(planned[gguf_name], dtype=np.float32)
        if ftype == LlamaFileType.MOSTLY_F16 and not _keep_f32(gguf_name, arr):
            arr = arr.astype(np.float16)
        writer.add_tensor(gguf_name, arr)
    writer.write_header_to_file(path=out_path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def export_gemma4_gguf(hf_dir: Path, out_path: Path, outtype: str = "f32") -> Path:
    """Write a Gemma-4 target (Gemma4ForConditionalGeneration's text path, or
    Gemma4ForCausalLM) to the GGUF file `out_path`, architecture `gemma4`.

    Dense, MoE and per-layer-input (E2B-like) variants; vision and audio
    towers are dropped. outtype "f16" keeps 1-D tensors, norms and the MoE
    gate input in F32, as llama.cpp's converter does.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = _Config.load(hf_dir, ("gemma4", "gemma4_text"))
    tensors = _load_tensors(hf_dir, lambda n: not _is_multimodal(n))
    planned = dict(_plan(tensors, cfg, _TARGET_GLOBAL, None))
    return _write(out_path, ARCH, hf_dir.name, cfg, hf_dir, outtype, planned)


def export_gemma4_assistant_gguf(
    hf_dir: Path, out_path: Path, outtype: str = "f32", *, tokenizer_dir: Path | None = None
) -> Path:
    """Write a Gemma-4 assistant (Gemma4AssistantForCausalLM) to the GGUF file
    `out_path`, architecture `gemma4-assistant`, for llama-server's `-md`.

    The centroid head (`masked_embedding.*`) is dropped, as llama.cpp's
    converter does: llama.cpp drafts from the full tied head. The file needs
    a vocabulary like any model's; `tokenizer_dir` (default `hf_dir`) names
    the directory whose tokenizer.json to write, normally the target's, as
    our assistant builder writes none by default.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    cfg = _Config.load(hf_dir, ("gemma4_assistant",))
    backbone = cfg.raw["backbone_hidden_size"]
    if backbone == cfg.raw["hidden_size"]:
        # [loader] load_arch_tensors refuses it: embedding_length_out must differ.
        raise ValueError("llama.cpp needs backbone_hidden_size != hidden_size")
    tensors = _load_tensors(hf_dir, lambda n: not _is_masked_embedding(n))
    if "lm_head.weight" in tensors:
        raise ValueError("an untied assistant lm_head is not supported by llama.cpp's loader")
    planned = dict(_plan(tensors, cfg, _ASSISTANT_GLOBAL, _ASSISTANT_LAYER))

    def extra(w: GGUFWriter) -> None:
        # [conv] Gemma4AssistantModel.set_gguf_parameters: the target's width is
        # the output width (the h it returns); every block is an MTP block.
        w.add_embedding_length_out(backbone)
        w.add_nextn_predict_layers(cfg.n_layer)

    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else hf_dir
    return _write(out_path, ASSISTANT_ARCH, hf_dir.name, cfg, tok_dir, outtype, planned, extra)
