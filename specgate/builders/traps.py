"""Rewrite a built checkpoint into one of the broken shapes met in the wild.

Each helper edits a checkpoint written by a builder (or any single- or
multi-shard safetensors checkpoint) in place, keeping dtypes, and returns its
path, so tests can show that loaders and `inspect` name the trap.
"""

from __future__ import annotations

from pathlib import Path

from ._build import read_config, read_shards, write_arrays, zero_centred_norm

_ZERO_CENTRED_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def apply_double_norm_shift(dest: Path) -> Path:
    """The "converted twice" trap: zero-centred norms shifted by +1 once more.

    Qwen3.5/Qwen3-Next store RMSNorm weights as w (scale 1 + w); a conversion
    adds 1 and, in mlx-lm's layout, also moves conv1d to [C, K, 1]. A tool
    that shifts the norms but leaves conv1d in HF's [C, 1, K] (mlx-lm PR
    #1456 reports converted -mtp checkpoints shifted twice) produces weights
    stored near 1.0 that every loader keyed on the conv1d layout will shift
    again, to scale ~2. The GDN gated norm, which stores its scale, is left
    alone, as is conv1d.
    """
    import mlx.core as mx

    dest = Path(dest)
    model_type = read_config(dest).get("model_type")
    if model_type not in _ZERO_CENTRED_FAMILIES:
        raise ValueError(f"{dest}: {model_type!r} has no zero-centred norms to shift")
    shards = read_shards(dest)
    for arrays in shards.values():
        for name, w in arrays.items():
            if zero_centred_norm(name):
                arrays[name] = (w.astype(mx.float32) + 1.0).astype(w.dtype)
    write_arrays(dest, shards)
    return dest


def apply_gemma4_norm_shift(dest: Path) -> Path:
    """The wrong-convention port: Gemma-4 norms stored for a (1 + w) RMSNorm.

    Gemma-4 scales by the stored weight (x * w); a converter that reuses
    Gemma-2/3's zero-centred convention stores w - 1, which a loader that
    (rightly) applies x * w turns into a scale near 0. Every RMSNorm weight
    of a Gemma-4 target or assistant is rewritten; `layer_scalar` is not a
    norm and is left alone.
    """
    import re

    import mlx.core as mx

    dest = Path(dest)
    cfg = read_config(dest)
    if not str(cfg.get("model_type", "")).startswith("gemma4"):
        raise ValueError(f"{dest}: {cfg.get('model_type')!r} is not a Gemma-4 checkpoint")
    norm = re.compile(r"norm(_\d)?\.weight$")  # every RMSNorm: q/k norms, _1/_2 ones
    shards = read_shards(dest)
    for arrays in shards.values():
        for name, w in arrays.items():
            if norm.search(name):
                arrays[name] = (w.astype(mx.float32) - 1.0).astype(w.dtype)
    write_arrays(dest, shards)
    return dest


def strip_mtp(dest: Path) -> Path:
    """The "converter stripped them" trap: no mtp.* tensors, config unchanged.

    The config still declares the MTP layers (mtp_num_hidden_layers or
    whatever key the family uses); a shard left holding nothing is deleted.
    """
    dest = Path(dest)
    shards = read_shards(dest)
    kept = {}
    for file_name, arrays in shards.items():
        arrays = {n: a for n, a in arrays.items() if not n.startswith("mtp.")}
        if arrays:
            kept[file_name] = arrays
        else:
            (dest / file_name).unlink()
    write_arrays(dest, kept)
    return dest
