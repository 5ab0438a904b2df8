"""Build a loaded model's MTP head from its checkpoint's own `mtp.*` tensors.

mlx-lm's sanitize drops every `mtp.*` tensor, so the trunk `load_mlx_model`
returns has no head. `load_mtp_head` reads them back: where they live
(embedded `mtp.*`, `language_model.mtp.*`, a sidecar such as
`mtp.safetensors`) and the checkpoint's layout come from
`specgate.engines.checkpoints.reader`; only the head's tensors are read (lazily, by
`mx.load`), never the trunk's again.

Per family, the MTP layer is the trunk's own full-attention decoder layer:

- `qwen3_5` (Qwen3.5/3.6 dense) and `qwen3_5_moe`: mlx-lm `qwen3_5.DecoderLayer`
  built from the trunk's `TextModelArgs`; an MoE layer's experts, per expert
  (`experts.{e}.{gate,up,down}_proj`) or fused (`experts.gate_up_proj`,
  `experts.down_proj`), become the `switch_mlp.*` stacks mlx-lm's SwitchGLU
  loads (fused: gate rows before up rows, split at the middle, as
  `qwen3_5_moe.Model.sanitize` does for the trunk; per expert: stacked in
  expert order, as `qwen3_next.Model.sanitize` does).
- `qwen3_next`: mlx-lm `qwen3_next.Qwen3NextDecoderLayer` from the trunk's
  `ModelArgs` (full attention, sparse MoE; the MLP kind follows the tensors).

Norms are zero-centred in raw HF checkpoints (scale 1 + w) and get +1 exactly
where mlx-lm shifts the trunk's: for qwen3_5/qwen3_5_moe when a conv1d weight
is still in HF layout [C, 1, K]; for qwen3_next when the trunk's experts are
still per expert (`model.layers.*.mlp.experts.0.up_proj.weight`): its
sanitize does nothing at all otherwise, conv1d or not.

The embedding and lm_head are the trunk's; the head holds neither.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from specgate.engines.checkpoints.reader import (
    _MTP_PREFIX,
    SIDECAR_FILES,
    CheckpointInfo,
    read_checkpoint,
)
from specgate.engines.drafting.mtp.head import ZERO_CENTRED_NORMS, MTPHead
from specgate.engines.loading import LoadedModel
from specgate.engines.precision import follow

log = logging.getLogger(__name__)

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

_LAYER = re.compile(r"^layers\.(\d+)\.")
# Tensors a head never takes from its checkpoint: the trunk's embedding and
# output head are shared (Qwen's `mtp_use_dedicated_embeddings: false`).
_SHARED_WITH_TRUNK = re.compile(r"^(embed_tokens|lm_head|shared_head)\.")
_QUANT_SUFFIXES = (".weight", ".scales", ".biases")


def load_mtp_head(loaded: LoadedModel) -> MTPHead:
    """The MTP head of `loaded`, its weights from the checkpoint's `mtp.*` tensors.

    Raises ValueError when the family has no MTP head loader, when the
    checkpoint holds no MTP tensors, or when they do not fit the head.
    """
    family = loaded.config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"{loaded.path}: no MTP head loader for model_type {family!r} "
            f"(supported: {', '.join(FAMILIES)})"
        )
    info = read_checkpoint(_checkpoint_dir(loaded.path))
    weights = _read_mtp_tensors(info)
    for name in [k for k in weights if _SHARED_WITH_TRUNK.match(k)]:
        log.info("%s: ignoring mtp.%s: the head uses the trunk's embedding and lm_head",
                 info.path, name)  # fmt: skip
        del weights[name]

    n_layers = _layer_count(info, weights)
    if family == "qwen3_next":
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        args, layer_cls = loaded.model.args, Qwen3NextDecoderLayer
        shift = _qwen3_next_unsanitized(info)
    else:
        from mlx_lm.models.qwen3_5 import DecoderLayer

        args, layer_cls = loaded.model.language_model.args, DecoderLayer
        shift = _qwen3_5_unsanitized(info)
    layers = [_mtp_layer(layer_cls, args, weights, j) for j in range(n_layers)]
    head = MTPHead(args.hidden_size, args.rms_norm_eps, layers)

    weights = experts_to_switch_mlp(weights, args.num_experts)
    if shift:
        weights = {k: _shift_norm(k, v) for k, v in weights.items()}
    _check_norm_evidence(info, shift)
    quantized = _quantize(head, weights, loaded, info)
    _check_fit(head, weights, info)
    head.load_weights(list(weights.items()), strict=True)
    follow(head, loaded.upcast)  # computes in the trunk's type (engines/precision.py)
    mx.eval(head.parameters())
    head.eval()
    log.info(
        "MTP head for %s: %d layer(s) from %s (%s*); norms %s; %s",
        family, n_layers, info.mtp.sidecar or "the trunk's weights", info.mtp.prefix,
        "shifted +1 (raw HF layout)" if shift else "used as stored (mlx layout)",
        quantized or "unquantized",
    )  # fmt: skip
    return head


# ---------------------------------------------------------------- reading


def _checkpoint_dir(path: str) -> Path:
    if Path(path).is_dir():
        return Path(path)
    from specgate.engines.checkpoints.inspect import UsageError, resolve_local

    try:  # a hub repo id mlx-lm loaded: its snapshot is in the local cache
        return resolve_local(path)
    except UsageError as e:
        raise ValueError(f"{path}: cannot find the checkpoint to read its MTP head ({e})") from e


def _read_mtp_tensors(info: CheckpointInfo) -> dict[str, mx.array]:
    """{name without its `mtp.` prefix: array}, read lazily from the files that hold them."""
    mtp = info.mtp
    if mtp.style != "qwen" or not mtp.tensor_names:
        if mtp.declared:
            raise ValueError(
                f"config declares {mtp.declared} MTP layers ({mtp.declared_key}) but the weights "
                f"hold no mtp.* tensors: {info.path} (a conversion stripped them; mlx-lm's "
                "converter does). Use a checkpoint that keeps mtp.*, or put the original "
                f"head beside it as {SIDECAR_FILES[0]}"
            )
        raise ValueError(
            f"the weights hold no mtp.* tensors and the config declares no MTP layers: "
            f"{info.path} has no MTP head"
        )
    wanted: dict[str, set[str]] = {}
    for name in mtp.tensor_names:
        wanted.setdefault(info.tensors[name].file, set()).add(name)
    sidecars = {str(Path(info.path) / s) for s in SIDECAR_FILES}
    out = {}
    for file, names in wanted.items():
        for raw, array in mx.load(file).items():
            # The reader names a sidecar's unprefixed tensors `mtp.<name>`.
            name = raw if file not in sidecars or _MTP_PREFIX.match(raw) else f"mtp.{raw}"
            if name in names:
                out[_MTP_PREFIX.sub("", name, count=1)] = array
    return out


def _layer_count(info: CheckpointInfo, weights: dict[str, mx.array]) -> int:
    found = sorted({int(m.group(1)) for k in weights if (m := _LAYER.match(k))})
    if found != list(range(len(found))) or not found:
        raise ValueError(
            f"{info.path}: the MTP tensors hold layers {found}; expected mtp.layers.0 .. N-1"
        )
    if info.mtp.declared and info.mtp.declared != len(found):
        log.warning("%s: config declares %d MTP layers (%s) but the weights hold %d; using %d",
                    info.path, info.mtp.declared, info.mtp.declared_key, len(found), len(found))  # fmt: skip
    return len(found)


# ---------------------------------------------------------------- per family


def _qwen3_5_unsanitized(info: CheckpointInfo) -> bool:
    # mlx-lm qwen3_5 TextModel.sanitize: shift iff a conv1d is in HF layout.
    return any(
        k.endswith("conv1d.weight") and m.shape and m.shape[-1] != 1
        for k, m in info.tensors.items()
    )


def _qwen3_next_unsanitized(info: CheckpointInfo) -> bool:
    # mlx-lm qwen3_next Model.sanitize returns the weights untouched unless the
    # trunk's experts are per expert; then it shifts every norm, conv1d or not.
    return any(
        k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight")
        for k in info.tensors
    )


def _mtp_layer(layer_cls, args, weights: dict[str, mx.array], j: int) -> nn.Module:
    """A full-attention decoder layer of the trunk's class; its MLP as the tensors say.

    The layer classes pick dense or MoE from the trunk layer's index
    (qwen3_next: mlp_only_layers, decoder_sparse_step); the MTP layer has no
    trunk index, so its own tensors decide (a router `mlp.gate` means MoE).
    """
    # Both families' layers use these two classes (qwen3_5 imports them).
    from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock

    layer = layer_cls(args, layer_idx=args.full_attention_interval - 1)
    moe = any(k.startswith(f"layers.{j}.mlp.gate.") for k in weights)
    if moe and args.num_experts > 0 and not isinstance(layer.mlp, Qwen3NextSparseMoeBlock):
        layer.mlp = Qwen3NextSparseMoeBlock(args)
    elif not moe and isinstance(layer.mlp, Qwen3NextSparseMoeBlock):
        layer.mlp = Qwen3NextMLP(args.hidden_size, args.intermediate_size)
    return layer


def experts_to_switch_mlp(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """MoE experts as mlx-lm's SwitchGLU holds them: `mlp.switch_mlp.{gate,up,down}_proj.*`.

    Fused (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`,
    no `.weight`): gate_up split at the middle of axis -2, gate first, as
    mlx-lm's qwen3_5_moe sanitize. Per expert (`experts.{e}.{n}.weight`):
    stacked over e, as mlx-lm's qwen3_next sanitize; `.scales`/`.biases` of
    quantized experts are split or stacked the same way. Already-converted
    `switch_mlp.*` tensors pass through.
    """
    out = dict(weights)
    blocks = sorted({k[: k.index(".experts.")] for k in weights if ".experts." in k})
    for p in blocks:
        for sfx in ("",) + _QUANT_SUFFIXES:
            if (gate_up := out.pop(f"{p}.experts.gate_up_proj{sfx}", None)) is not None:
                mid = gate_up.shape[-2] // 2
                dst = sfx or ".weight"
                out[f"{p}.switch_mlp.gate_proj{dst}"] = gate_up[..., :mid, :]
                out[f"{p}.switch_mlp.up_proj{dst}"] = gate_up[..., mid:, :]
            if (down := out.pop(f"{p}.experts.down_proj{sfx}", None)) is not None:
                out[f"{p}.switch_mlp.down_proj{sfx or '.weight'}"] = down
        for n in ("gate_proj", "up_proj", "down_proj"):
            for sfx in _QUANT_SUFFIXES:
                if f"{p}.experts.0.{n}{sfx}" not in out:
                    continue
                names = [f"{p}.experts.{e}.{n}{sfx}" for e in range(num_experts)]
                missing = [k for k in names if k not in out]
                if missing:
                    raise ValueError(
                        f"MTP MoE block mtp.{p} stores experts one by one but lacks "
                        f"{len(missing)} of {num_experts}: mtp.{missing[0]}, ..."
                    )
                out[f"{p}.switch_mlp.{n}{sfx}"] = mx.stack([out.pop(k) for k in names])
        left = sorted(k for k in out if k.startswith(f"{p}.experts."))
        if left:
            raise ValueError(
                f"MTP MoE block mtp.{p}: tensors in no known expert layout "
                f"(expected {num_experts} experts): mtp.{left[0]}, ..."
            )
    return out


def _shift_norm(name: str, value: mx.array) -> mx.array:
    if value.ndim == 1 and name.endswith(ZERO_CENTRED_NORMS):
        return value + 1.0
    return value


def _check_norm_evidence(info: CheckpointInfo, shift: bool) -> None:
    """Warn when the stored MTP norms contradict the layout (the double-shift trap)."""
    mean = info.norms.mtp_mean if info.norms else None
    if mean is None:
        return
    if shift and mean > 0.5:
        log.warning("%s: MTP norms are stored near %.2f, yet the layout is raw HF (zero-centred, "
                    "stored near 0): they look shifted already and load with scale ~2 "
                    "(a conversion shifted them twice?)", info.path, mean)  # fmt: skip
    elif not shift and mean < 0.5:
        log.warning("%s: MTP norms are stored near %.2f in an mlx-sanitized layout (stored as "
                    "1 + w, near 1): their +1 shift looks lost", info.path, mean)  # fmt: skip


# ---------------------------------------------------------------- quantization, shapes


def _quantize(head: MTPHead, weights: dict, loaded: LoadedModel, info: CheckpointInfo) -> str:
    """Quantize the head's layers whose tensors are quantized; '' if none are."""
    config_q = loaded.config.get("quantization") or loaded.text_config.get("quantization")
    if not any(k.endswith(".scales") for k in weights):
        if config_q:
            log.info("%s: the trunk is quantized (%s-bit, group size %s) but the MTP tensors "
                     "are not: loading the head unquantized", info.path,
                     config_q.get("bits"), config_q.get("group_size"))  # fmt: skip
        return ""
    from mlx_lm.utils import infer_quant_config

    config_q = config_q or {}
    seen: set[tuple] = set()

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        if f"{path}.weight" not in weights:
            raise ValueError(f"{info.path}: mtp.{path}.scales has no mtp.{path}.weight")
        # Bits and group size from the stored shapes (mlx-lm's load does the
        # same): a head may be quantized differently from the trunk.
        params = infer_quant_config(path, module, weights)
        seen.add((params["bits"], params["group_size"], params["mode"]))
        return params

    nn.quantize(
        head,
        group_size=config_q.get("group_size"),
        bits=config_q.get("bits"),
        mode=config_q.get("mode", "affine"),
        class_predicate=predicate,
    )
    return "quantized " + ", ".join(f"{b}-bit group {g} {m}" for b, g, m in sorted(seen))


def _check_fit(head: MTPHead, weights: dict[str, mx.array], info: CheckpointInfo) -> None:
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    mismatched = [
        f"mtp.{k}: checkpoint {tuple(weights[k].shape)}, head {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and tuple(weights[k].shape) != tuple(v.shape)
    ]
    problems = []
    if mismatched:
        problems.append("shapes do not match the config: " + "; ".join(mismatched[:6]))
    if missing:
        problems.append("missing " + ", ".join(f"mtp.{k}" for k in missing[:6]))
    if unexpected:
        problems.append("unexpected " + ", ".join(f"mtp.{k}" for k in unexpected[:6]))
    if problems:
        raise ValueError(f"{info.path}: the MTP tensors do not fit the head: " + "; ".join(problems))
