"""Tiny random drafter checkpoints in their published layouts.

- DFlash (z-lab): a block drafter for a dense Qwen3 target, conditioned on
  hidden states of named target layers. No embedding and no LM head: it
  borrows the target's. Layout confirmed from z-lab/dflash `model.py`
  (DFlashDraftModel's modules; `_draft_value` reads `dflash_config` first).
- DSpark (DeepSeek, DeepSpec repo): the same backbone with its own frozen
  copies of the target's `embed_tokens` and `lm_head`, a low-rank Markov
  head and a confidence head. Names follow DeepSpec's Qwen3DSparkModel and
  VanillaMarkov modules, unprefixed; the published HF file layout is
  UNCONFIRMED (no released checkpoint or loader was found), see
  LAYOUT_CONFIRMED.
- Gemma-4 assistant (Google): a 4-layer, fully KV-shared Gemma-4 text
  decoder between a pre- and a post-projection, with a tied LM head and an
  optional centroid-masked head. Confirmed from transformers
  `configuration_gemma4_assistant.py` / `modeling_gemma4_assistant.py`.

DFlash and DSpark drafters are built against a target directory: hidden
size, vocabulary and attention geometry come from its config.json, as the
real drafters' configs are copies of their target's. All norms here are
plain RMSNorms (scale = w).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._build import (
    Tensors,
    _Init,
    attention,
    decoder_layer,
    glu,
    read_config,
    read_tensors,
    save_safetensors,
    write_json,
)
from .tiny import LAYOUT_CONFIRMED, UNCONFIRMED
from .tokenizer import SPECIAL_TOKENS, build_tokenizer

__all__ = [
    "LAYOUT_CONFIRMED",
    "UNCONFIRMED",
    "build_dflash_drafter",
    "build_dspark_drafter",
    "build_gemma4_assistant",
    "default_target_layer_ids",
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's `build_target_layer_ids`: one target layer per draft layer, spread
    evenly over [1, L-3] ([1, 9, 17, 25, 33] for 36 layers and 5 draft layers,
    as DeepSpec's configs also use). The range is widened for tiny targets,
    where L-3 would leave fewer layers than the draft needs."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = 1
    end = max(num_target_layers - 3, start + num_draft_layers - 1)
    if end > num_target_layers - 1:
        raise ValueError(
            f"a {num_target_layers}-layer target cannot feed {num_draft_layers} draft layers"
        )
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _default_mask_token_id(vocab_size: int) -> int:
    # Qwen3 drafters use 151669, the first id past the tokenizer: an unused row
    # of the padded embedding. The tiny target's vocabulary has no padding, so
    # take the last (rarest) BPE merge, just below the special tokens.
    return vocab_size - len(SPECIAL_TOKENS) - 1


_QWEN3_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
               "num_hidden_layers", "bos_token_id", "eos_token_id")


def _qwen3_target(target: Path) -> dict:
    """The target's config as the Qwen3 config a drafter copies.

    Drafters for hybrid Qwen3.5 targets are still Qwen3 networks (z-lab's
    Qwen3.5 DFlash drafters are), with the target's width, heads and vocab.
    """
    cfg = read_config(target)
    kind = cfg.get("model_type")
    if kind == "qwen3":
        return cfg
    if kind == "qwen3_5":
        text = cfg.get("text_config", cfg)
        rope = text.get("rope_parameters") or {}
        return {k: text[k] for k in _QWEN3_KEYS if k in text} | {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_theta": rope.get("rope_theta", text.get("rope_theta", 1_000_000)),
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "torch_dtype": text.get("dtype", cfg.get("dtype", "float32")),
        }
    raise ValueError(
        f"{target}: drafter builders take a Qwen3 or Qwen3.5 target, got {kind!r}"
    )


def _check_layer_ids(ids: Sequence[int], num_target_layers: int, *, allow_embedding: bool) -> list:
    ids = [int(i) for i in ids]
    low = -1 if allow_embedding else 0
    ok = ids and all(low <= i < num_target_layers for i in ids)
    if not ok or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError(
            f"target_layer_ids {ids} must be strictly increasing in "
            f"[{low}, {num_target_layers - 1}]"
        )
    return ids


def _draft_config(
    target_cfg: dict, *, architecture: str, num_hidden_layers: int, dtype: str
) -> dict:
    """The target's config with the draft's depth: both drafters are built this way."""
    cfg = dict(target_cfg)
    dtype_key = "torch_dtype" if "torch_dtype" in cfg else "dtype"
    cfg |= {
        "architectures": [architecture],
        "num_hidden_layers": num_hidden_layers,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "tie_word_embeddings": False,
        dtype_key: dtype,
    }
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = num_hidden_layers
    return cfg


def _backbone(init: _Init, cfg: dict, num_context_layers: int) -> Tensors:
    """The DFlash/DSpark backbone: context fusion, Qwen3 layers, final norm (no prefix)."""
    h = cfg["hidden_size"]
    # fc fuses the concatenated target hidden states of the named layers.
    tensors = {
        "fc.weight": init.linear(h, num_context_layers * h),
        "hidden_norm.weight": init.norm(h, zero_centred=False),
    }
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"layers.{i}."
        mixer = attention(init, prefix, cfg, output_gate=False, zero_centred=False)
        tensors |= decoder_layer(init, prefix, cfg, mixer=mixer, zero_centred=False)
    tensors["norm.weight"] = init.norm(h, zero_centred=False)
    return tensors


def _copy_tokenizer(target: Path, dest: Path, vocab_size: int) -> None:
    """The target's own tokenizer files, so the drafter directory stands alone."""
    if all((target / name).is_file() for name in _TOKENIZER_FILES):
        for name in _TOKENIZER_FILES:
            shutil.copyfile(target / name, dest / name)
    else:
        build_tokenizer(dest, vocab_size=vocab_size)


def build_dflash_drafter(
    dest: Path,
    *,
    target: Path,
    num_hidden_layers: int = 2,
    block_size: int = 16,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: bool = True,
) -> Path:
    """Write a random z-lab DFlash drafter for the Qwen3 / Qwen3.5 model at `target`.

    config.json is the target's Qwen3 config with the draft's depth, plus
    `block_size`, `num_target_layers` and `dflash_config{target_layer_ids,
    mask_token_id}`. Tensors, unprefixed: `fc [H, n*H]` (n = number of target
    layers), `hidden_norm`, `layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`,
    `k_norm`, `layers.{i}.mlp.*`, the two layer norms, `norm`. No embedding,
    no lm_head: the drafter uses the target's.
    """
    dest, target = Path(dest), Path(target)
    target_cfg = _qwen3_target(target)
    n_target = target_cfg["num_hidden_layers"]
    ids = _check_layer_ids(
        target_layer_ids or default_target_layer_ids(n_target, num_hidden_layers),
        n_target,
        allow_embedding=False,
    )
    vocab = target_cfg["vocab_size"]
    cfg = _draft_config(
        target_cfg,
        architecture="DFlashDraftModel",
        num_hidden_layers=num_hidden_layers,
        dtype=dtype,
    )
    cfg |= {
        "block_size": block_size,
        "dflash_config": {
            "mask_token_id": _default_mask_token_id(vocab)
            if mask_token_id is None
            else mask_token_id,
            "target_layer_ids": ids,
        },
    }
    dest.mkdir(parents=True, exist_ok=True)
    write_json(dest / "config.json", dict(sorted(cfg.items())))
    save_safetensors(dest, _backbone(_Init(seed), cfg, len(ids)), dtype)
    if tokenizer:
        _copy_tokenizer(target, dest, vocab)
    return dest


def build_dspark_drafter(
    dest: Path,
    *,
    target: Path,
    num_hidden_layers: int = 2,
    block_size: int = 7,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    markov_rank: int = 16,
    markov_head_type: str = "vanilla",
    enable_confidence_head: bool = True,
    confidence_head_with_markov: bool = True,
    num_anchors: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: bool = True,
) -> Path:
    """Write a random DeepSpec DSpark drafter for the Qwen3 / Qwen3.5 model at `target`.

    config.json, as DeepSpec's `build_draft_config` makes it: the target's
    config with `architectures ["Qwen3DSparkModel"]`, the draft's depth,
    `num_target_layers`, `block_size` (the proposal count, 7 in the released
    configs), `mask_token_id`, `target_layer_ids` (-1 = embedding output),
    `num_anchors`, `enable_confidence_head`, `markov_rank`, and, when they
    apply, `markov_head_type` and `confidence_head_with_markov`.
    Tensors, unprefixed: the DFlash backbone plus `embed_tokens` and `lm_head`
    copied from the target (DeepSpec initialises them from it and freezes
    them), `markov_head.markov_w1.weight [V, r]` (an Embedding),
    `markov_head.markov_w2.weight [V, r]` (Linear r -> V) and
    `confidence_head.proj.{weight [1, H(+r)], bias [1]}`. markov_rank=0 gives
    DeepSpec's `dflash_*` variant (no Markov head). The published HF file
    layout is UNCONFIRMED (LAYOUT_CONFIRMED["build_dspark_drafter"] is False).
    """
    if markov_rank and markov_head_type != "vanilla":
        # DeepSpec forks add "gated"/"rnn" heads with more tensors; not modelled.
        raise ValueError(f"only the vanilla Markov head is built, got {markov_head_type!r}")
    if confidence_head_with_markov and enable_confidence_head and not markov_rank:
        raise ValueError("confidence_head_with_markov needs markov_rank > 0")
    dest, target = Path(dest), Path(target)
    target_cfg = _qwen3_target(target)
    n_target = target_cfg["num_hidden_layers"]
    ids = _check_layer_ids(
        target_layer_ids or default_target_layer_ids(n_target, num_hidden_layers),
        n_target,
        allow_embedding=True,
    )
    h, vocab = target_cfg["hidden_size"], target_cfg["vocab_size"]
    cfg = _draft_config(
        target_cfg,
        architecture="Qwen3DSparkModel",
        num_hidden_layers=num_hidden_layers,
        dtype=dtype,
    )
    cfg |= {
        "block_size": block_size,
        "mask_token_id": _default_mask_token_id(vocab) if mask_token_id is None else mask_token_id,
        "target_layer_ids": ids,
        "num_anchors": num_anchors,
        "enable_confidence_head": enable_confidence_head,
        "markov_rank": markov_rank,
    }
    if markov_rank:
        cfg["markov_head_type"] = markov_head_type
    if enable_confidence_head:
        cfg["confidence_head_with_markov"] = confidence_head_with_markov

    init = _Init(seed)
    tensors = _backbone(init, cfg, len(ids))
    tied = target_cfg.get("tie_word_embeddings", False)
    # Qwen3.5 keeps its text model under model.language_model.
    prefix = "model.language_model." if read_config(target).get("model_type") == "qwen3_5" else "model."
    embed = f"{prefix}embed_tokens.weight"
    head_name = embed if tied else "lm_head.weight"
    copied = read_tensors(target, sorted({embed, head_name}))
    tensors["embed_tokens.weight"] = copied[embed]
    tensors["lm_head.weight"] = copied[head_name]
    if markov_rank:
        # Bias w2 . w1[prev] of std ~1, beside base logits of std ~3.
        tensors["markov_head.markov_w1.weight"] = init.normal((vocab, markov_rank), 1.0)
        tensors["markov_head.markov_w2.weight"] = init.linear(vocab, markov_rank)
    if enable_confidence_head:
        width = h + (markov_rank if confidence_head_with_markov else 0)
        tensors["confidence_head.proj.weight"] = init.linear(1, width)
        tensors["confidence_head.proj.bias"] = init.normal((1,), 1.0)
    dest.mkdir(parents=True, exist_ok=True)
    write_json(dest / "config.json", dict(sorted(cfg.items())))
    save_safetensors(dest, tensors, dtype)
    if tokenizer:
        _copy_tokenizer(target, dest, vocab)
    return dest


def _gemma4_text_config(
    *,
    hidden_size: int,
    num_hidden_layers: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    global_head_dim: int,
    vocab_size: int,
    sliding_window: int,
    max_position_embeddings: int,
    dtype: str,
    attention_k_eq_v: bool = False,
    num_global_key_value_heads: int | None = None,
) -> dict:
    # Keys and values of the released assistants (E2B/E4B), scaled down: three
    # sliding layers then one full one, every layer KV-shared with the target.
    return {
        "model_type": "gemma4_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": attention_k_eq_v,
        "dtype": dtype,
        "enable_moe_block": False,
        "final_logit_softcapping": None,
        "global_head_dim": global_head_dim,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden_size,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": ["sliding_attention"] * (num_hidden_layers - 1) + ["full_attention"],
        "max_position_embeddings": max_position_embeddings,
        # transformers writes every Gemma4TextConfig key (llama.cpp's converter
        # looks the MoE ones up unconditionally).
        "moe_intermediate_size": None,
        "num_attention_heads": num_attention_heads,
        "num_experts": None,
        "num_global_key_value_heads": num_global_key_value_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "num_kv_shared_layers": num_hidden_layers,
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
        "top_k_experts": None,
        "use_double_wide_mlp": False,
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": 0,
    }


def _gemma4_assistant_tensors(seed: int, config: dict) -> Tensors:
    init = _Init(seed)
    tc = config["text_config"]
    h, h_b, vocab = tc["hidden_size"], config["backbone_hidden_size"], tc["vocab_size"]
    n_heads = tc["num_attention_heads"]
    # Tied: the embedding is the output head, scaled for logits of std ~3.
    embed = init.normal((vocab, h), 3 / np.sqrt(h))
    tensors = {"model.embed_tokens.weight": embed}
    for i, kind in enumerate(tc["layer_types"]):
        p = f"model.layers.{i}."
        hd = tc["global_head_dim"] if kind == "full_attention" else tc["head_dim"]
        # KV-shared layers own no k/v projections or norms: they attend to the
        # target's last sliding and last full layer's K/V.
        tensors |= {
            f"{p}self_attn.q_proj.weight": init.linear(n_heads * hd, h),
            f"{p}self_attn.q_norm.weight": init.norm(hd, zero_centred=False),
            f"{p}self_attn.o_proj.weight": init.linear(h, n_heads * hd),
        }
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            tensors[f"{p}{norm}_layernorm.weight"] = init.norm(h, zero_centred=False)
        tensors |= glu(init, f"{p}mlp.", h, tc["intermediate_size"])
        # Scales the whole residual stream at the layer's end; the released
        # E2B assistant's are 0.04-0.43.
        tensors[f"{p}layer_scalar"] = init.rng.uniform(0.05, 0.5, (1,)).astype(np.float32)
    tensors["model.norm.weight"] = init.norm(h, zero_centred=False)
    # Input is [target_embed(token) * sqrt(H_b), target hidden]; output is the next hidden.
    tensors["pre_projection.weight"] = init.linear(h, 2 * h_b)
    tensors["post_projection.weight"] = init.linear(h_b, h)
    if config["use_ordered_embeddings"]:
        n_c = config["num_centroids"]
        ordering = init.rng.permutation(vocab).astype(np.int64)
        # Centroid c scores the tokens ordering.view(C, V/C)[c]; the mean of
        # their embeddings (times sqrt(V/C), for centroid logits of std ~3)
        # makes the top clusters tend to hold the top tokens, as trained ones do.
        members = embed[ordering.reshape(n_c, vocab // n_c)]
        tensors["masked_embedding.centroids.weight"] = (
            members.mean(axis=1) * np.sqrt(vocab // n_c)
        ).astype(np.float32)
        tensors["masked_embedding.token_ordering"] = ordering
    return tensors


def build_gemma4_assistant(
    dest: Path,
    *,
    target_hidden_size: int = 128,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    intermediate_size: int = 128,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 32,
    global_head_dim: int = 64,
    vocab_size: int = 2048,
    use_ordered_embeddings: bool = True,
    num_centroids: int = 64,
    centroid_intermediate_top_k: int = 8,
    sliding_window: int = 512,
    max_position_embeddings: int = 131072,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: bool = True,
    target: Path | None = None,
) -> Path:
    """Write a random Gemma-4 assistant drafter (Gemma4AssistantForCausalLM) to dest.

    With `target` (a Gemma-4 checkpoint directory), the sizes the pair must
    share are the target's: backbone_hidden_size, vocabulary, head widths,
    K/V heads and sliding window.

    Tensors: `model.embed_tokens` (also the tied lm_head, not stored),
    `model.layers.{i}.self_attn.{q_proj, q_norm, o_proj}` (q of width
    `global_head_dim` on the full-attention layer), the four layer norms,
    `mlp.{gate,up,down}_proj`, `layer_scalar [1]`; `model.norm`;
    `pre_projection [H, 2*H_b]`, `post_projection [H_b, H]`; and, with
    `use_ordered_embeddings` (E2B/E4B; the 26B/31B assistants use the plain
    tied head), `masked_embedding.centroids.weight [C, H]` and
    `masked_embedding.token_ordering [V]` (int64). The tokenizer written is
    this repo's Qwen-format one, not Gemma's.
    """
    if target is not None:
        cfg = json.loads((Path(target) / "config.json").read_text())
        tc = cfg.get("text_config") or cfg
        target_hidden_size, head_dim = tc["hidden_size"], tc["head_dim"]
        vocab_size = cfg.get("vocab_size") or tc["vocab_size"]
        global_head_dim = tc.get("global_head_dim") or head_dim
        num_key_value_heads = tc["num_key_value_heads"]
        sliding_window = tc["sliding_window"]
        # Full layers with keys as values (26B/31B) and their own K/V head count.
        k_eq_v, global_kv_heads = tc.get("attention_k_eq_v", False), tc.get("num_global_key_value_heads")
    else:
        k_eq_v, global_kv_heads = False, None
    if use_ordered_embeddings and vocab_size % num_centroids:
        raise ValueError(f"vocab_size {vocab_size} must be a multiple of num_centroids")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target_hidden_size,
        "centroid_intermediate_top_k": centroid_intermediate_top_k,
        "dtype": dtype,
        "num_centroids": num_centroids,
        "text_config": _gemma4_text_config(
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            intermediate_size=intermediate_size,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            vocab_size=vocab_size,
            sliding_window=sliding_window,
            max_position_embeddings=max_position_embeddings,
            dtype=dtype,
            attention_k_eq_v=k_eq_v,
            num_global_key_value_heads=global_kv_heads,
        ),
        "tie_word_embeddings": True,
        "use_ordered_embeddings": use_ordered_embeddings,
    }
    write_json(dest / "config.json", config)
    save_safetensors(dest, _gemma4_assistant_tensors(seed, config), dtype)
    if tokenizer:
        build_tokenizer(dest, vocab_size=vocab_size)
    return dest
