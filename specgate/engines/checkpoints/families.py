"""Which model families specgate knows, and what their MTP heads must look like.

A family is "verified" when specgate implements its MTP head and the
tensor layout is confirmed by published source (vLLM, mlx-lm, mlx-vlm,
llama.cpp: see reference/model-formats-and-algorithms.md). Anything else
mlx-lm can load is still a plain-decoding target.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .info import CheckpointInfo


@dataclass(frozen=True)
class Family:
    name: str
    mtp_style: str | None  # "qwen" (top-level mtp.*), "nextn" (model.layers.N), None
    zero_centred: bool  # RMSNorm stored as w, effective scale 1 + w
    mtp_verified: bool  # mlx_mtp implements it and the layout is confirmed
    # The config key its releases declare the head with; None where releases
    # declare nothing and readers find the head by its tensors (Qwen3-Next:
    # neither transformers' config nor the published config.json has one).
    mtp_key: str | None = None
    # Norms that store the scale itself (x * w, stored near 1) and whose
    # ports have been met storing them zero-centred: inspect checks them.
    scale_norms: bool = False


_QWEN_HYBRID = "hybrid (GatedDeltaNet + gated attention)"
_NEXTN = "num_nextn_predict_layers"
FAMILIES = {
    "qwen3_5": Family(f"Qwen3.5/3.6 {_QWEN_HYBRID}", "qwen", True, True, "mtp_num_hidden_layers"),
    "qwen3_5_moe": Family(f"Qwen3.5/3.6 MoE {_QWEN_HYBRID}", "qwen", True, True,
                          "mtp_num_hidden_layers"),
    "qwen3_next": Family(f"Qwen3-Next MoE {_QWEN_HYBRID}", "qwen", True, True, None),
    "deepseek_v3": Family("DeepSeek-V3 (nextn MTP layer)", "nextn", False, True, _NEXTN),
    # Same nextn layout, but specgate's head is not checked against them.
    "deepseek_v32": Family("DeepSeek-V3.2 (nextn MTP layer)", "nextn", False, False, _NEXTN),
    "glm4_moe": Family("GLM-4.5/4.6 MoE (nextn MTP layer)", "nextn", False, False, _NEXTN),
    # MTP by a separate -assistant drafter (engines/drafting/assistant/), not a head.
    "gemma4": Family("Gemma-4 (sliding + full attention)", None, False, False, scale_norms=True),
    "gemma4_text": Family("Gemma-4 (sliding + full attention)", None, False, False,
                          scale_norms=True),
    "qwen3": Family("Qwen3 dense", None, False, False),
    "qwen3_moe": Family("Qwen3 MoE", None, False, False),
}
# Qwen3.x names not yet released (3.8, ...) that keep the hybrid + mtp.* shape.
_QWEN3X = re.compile(r"^qwen3_\d+(_moe)?(_text)?$")
UNKNOWN_QWEN3X = Family(f"Qwen3.x {_QWEN_HYBRID}, unknown variant", "qwen", True, False,
                        "mtp_num_hidden_layers")


# What transformers writes for a text-only save (its *ForCausalLM class: a
# flat config, weights under `model.`), and the mlx-lm model that reads that
# layout: Qwen3.5's ModelArgs takes a flat config as its text_config, and its
# sanitize maps `model.*` to `language_model.model.*`. mlx-lm 0.32 has no
# module under the text-only names, so it refuses them as they are.
TEXT_ONLY_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def family_of(info: CheckpointInfo) -> Family | None:
    for mt in (info.model_type, info.text_model_type):
        mt = TEXT_ONLY_MODEL_TYPES.get(mt, mt)
        if mt in FAMILIES:
            return FAMILIES[mt]
    for mt in (info.model_type, info.text_model_type):
        if mt and _QWEN3X.match(mt) and "linear_attention" in info.layer_types:
            return UNKNOWN_QWEN3X
    return None


@cache
def _mlx_lm_models() -> tuple[Path | None, dict[str, str]]:
    # Found without importing mlx_lm (which pulls in transformers: seconds).
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None, {}
    pkg = Path(next(iter(spec.submodule_search_locations)))
    remap: dict[str, str] = {}
    try:
        tree = ast.parse((pkg / "utils.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING" for t in node.targets
            ):
                remap = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    return pkg / "models", remap


def mlx_lm_module(model_type: str | None) -> str | None:
    """The mlx-lm model module that loads this model_type (after mlx-lm's own
    remapping, then specgate's text-only names), or None if there is none."""
    if not model_type:
        return None
    models, remap = _mlx_lm_models()
    if models is None:
        return None
    for mt in (remap.get(model_type, model_type), TEXT_ONLY_MODEL_TYPES.get(model_type)):
        if mt and (models / f"{mt.replace('-', '_')}.py").exists():
            return mt
    return None


def mlx_lm_supports(model_type: str | None) -> bool:
    """Whether mlx-lm (hence mlx_plain) has a model for this model_type."""
    return mlx_lm_module(model_type) is not None


# llama.cpp (vendored b11312) archs with an MTP graph (LLM_GRAPH_TYPE_DECODER_MTP),
# from reference/llamacpp-route.md. Only qwen35/qwen35moe were run end to end.
GGUF_MTP_ARCHS = {
    "qwen35", "qwen35moe", "qwen3next", "glm4moe", "glm-dsa", "glm5-next", "deepseek2",
    "deepseek32", "deepseek4", "mimo2", "step35", "bailingmoe3", "cohere2moe", "hy-v3",
    "nemotron-h-moe",
}
GGUF_MTP_VERIFIED = {"qwen35", "qwen35moe"}
# llama.cpp's Qwen3.5 MTP asserts n_layer_nextn == 1.
GGUF_SINGLE_HEAD = {"qwen35", "qwen35moe"}


# Drafters in a GGUF of their own, given to llama-server with -md beside the
# target they were released for (gguf 0.19's names lack it; llama.cpp b11312
# has src/models/gemma4-assistant.cpp).
GGUF_ASSISTANT_ARCHS = {"gemma4-assistant": "gemma4"}


def gguf_known_arch(arch: str) -> bool:
    from gguf.constants import MODEL_ARCH_NAMES

    return arch in GGUF_MTP_ARCHS or arch in GGUF_ASSISTANT_ARCHS or arch in MODEL_ARCH_NAMES.values()


# ---------------------------------------------------------------- MTP head shapes


def _packed(info: CheckpointInfo, name: str) -> bool:
    # mlx-quantized linears store packed uint32 words: no shape to compare.
    return name.rsplit(".", 1)[0] + ".scales" in info.tensors


def _expect(info: CheckpointInfo, name: str, shape: tuple[int, ...] | None,
            missing: list[str], wrong: list[str]) -> None:
    meta = info.tensors.get(name)
    if meta is None:
        missing.append(name)
    elif shape is not None and not _packed(info, name) and meta.shape != shape:
        wrong.append(f"{name} is {list(meta.shape)}, expected {list(shape)}")


def check_mtp_head(info: CheckpointInfo) -> tuple[list[str], list[str]]:
    """(missing tensors, wrong shapes) of the MTP head against the config."""
    h, tc = info.hidden_size, info.text_config
    missing: list[str] = []
    wrong: list[str] = []
    if not h:
        return missing, wrong
    if info.mtp.style == "qwen":
        p = info.mtp.prefix or "mtp."
        hd, n_q = info.head_dim, info.num_attention_heads
        n_kv = info.num_key_value_heads
        gate = 2 if tc.get("attn_output_gate", True) else 1
        _expect(info, f"{p}fc.weight", (h, 2 * h), missing, wrong)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            _expect(info, f"{p}{n}.weight", (h,), missing, wrong)
        for j in range(max(info.mtp.present, 1)):
            lp = f"{p}layers.{j}."
            for n in ("input_layernorm", "post_attention_layernorm"):
                _expect(info, f"{lp}{n}.weight", (h,), missing, wrong)
            a = f"{lp}self_attn."
            if hd and n_q and n_kv:
                _expect(info, f"{a}q_proj.weight", (gate * n_q * hd, h), missing, wrong)
                _expect(info, f"{a}k_proj.weight", (n_kv * hd, h), missing, wrong)
                _expect(info, f"{a}v_proj.weight", (n_kv * hd, h), missing, wrong)
                _expect(info, f"{a}o_proj.weight", (h, n_q * hd), missing, wrong)
                _expect(info, f"{a}q_norm.weight", (hd,), missing, wrong)
                _expect(info, f"{a}k_norm.weight", (hd,), missing, wrong)
            if not any(k.startswith(f"{lp}mlp.") for k in info.tensors):
                missing.append(f"{lp}mlp.*")
    elif info.mtp.style == "nextn":
        p = info.mtp.prefix
        _expect(info, f"{p}eh_proj.weight", (h, 2 * h), missing, wrong)
        for n in ("enorm", "hnorm", "shared_head.norm"):
            _expect(info, f"{p}{n}.weight", (h,), missing, wrong)
    return missing, wrong
