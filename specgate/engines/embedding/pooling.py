"""How an embedding checkpoint turns hidden states into one vector per input.

The checkpoint says it the way sentence-transformers saves it: `modules.json`
lists the modules applied after the transformer (a `Pooling` module whose
folder's `config.json` names the mode, then `Normalize`), and
`config_sentence_transformers.json` may name prompts. A decoder embedding
model without those files (a Qwen3-Embedding re-save) pools its last token
and normalizes, as Qwen3-Embedding does. A module specgate does not apply
(a `Dense` projection, an unknown pooling mode) is refused at load, by name:
vectors without it would be quietly wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

PoolingMode = Literal["last", "mean", "cls"]

# sentence-transformers' Pooling config keys, by the mode each turns on.
_ST_MODES: dict[str, PoolingMode] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST = "sentence_transformers.models."


class PoolingError(ValueError):
    """A checkpoint whose pooling specgate cannot apply; says which module."""


@dataclass(frozen=True)
class Pooling:
    mode: PoolingMode = "last"
    normalize: bool = True
    # `dimensions` may cut vectors to a prefix (Matryoshka training): True,
    # or the sizes the checkpoint was trained at (config `matryoshka_dimensions`).
    matryoshka: bool | tuple[int, ...] = False

    def allows(self, dimensions: int) -> bool:
        if isinstance(self.matryoshka, tuple):
            return dimensions in self.matryoshka
        return self.matryoshka


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_pooling(root: Path) -> Pooling | None:
    """The checkpoint's declared pooling, or None when it declares none."""
    modules = _json(root / "modules.json")
    if not isinstance(modules, list):
        return None
    mode: PoolingMode | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind == _ST + "Transformer" or not kind:
            continue
        if kind == _ST + "Pooling":
            config = _json(root / str(module.get("path", "")) / "config.json") or {}
            on = [m for key, m in _ST_MODES.items() if config.get(key)]
            other = [k for k, v in config.items() if k.startswith("pooling_mode_") and v
                     and k not in _ST_MODES]  # fmt: skip
            if other or len(on) != 1:
                raise PoolingError(f"{root}: pooling {other or on or 'none'} is not one specgate "
                                   f"applies (one of {', '.join(_ST_MODES)})")  # fmt: skip
            mode = on[0]
        elif kind == _ST + "Normalize":
            normalize = True
        else:
            raise PoolingError(f"{root}: modules.json lists {kind}, which specgate does not "
                               "apply; its vectors would differ from the model's")  # fmt: skip
    if mode is None:
        return None
    return Pooling(mode, normalize)


def matryoshka_of(config: dict) -> bool | tuple[int, ...]:
    """What the model's config says of Matryoshka training."""
    sizes = config.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return tuple(sorted(sizes))
    return bool(config.get("is_matryoshka"))


def pool(hidden: np.ndarray, lengths: list[int], mode: PoolingMode) -> np.ndarray:
    """(B, T, H) hidden states of right-padded rows -> (B, H), each row from
    its own `lengths[b]` positions (padding never reaches a vector: the
    attention is causal and the pad sits after every real token)."""
    rows = np.arange(hidden.shape[0])
    if mode == "last":
        return hidden[rows, np.asarray(lengths) - 1]
    if mode == "cls":
        return hidden[:, 0]
    mask = np.arange(hidden.shape[1])[None, :] < np.asarray(lengths)[:, None]
    return (hidden * mask[..., None]).sum(axis=1) / np.asarray(lengths, hidden.dtype)[:, None]


def finish(vectors: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """Cut to `dimensions` (a Matryoshka prefix), then normalize to unit
    length where the model does: a cut vector is normalized again, so it
    is a unit vector as OpenAI's `dimensions` returns one."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors


def configured(declared: Pooling | None, model_config: dict, *, mode: PoolingMode | None = None,
               normalize: bool | None = None, matryoshka: bool | None = None) -> Pooling:
    """The pooling a model serves with: each value the config sets, else
    the checkpoint's declared one, else Qwen3-Embedding's (last token,
    normalized); Matryoshka from the config, else the checkpoint's config.json."""
    base = declared or Pooling()
    return Pooling(mode or base.mode, base.normalize if normalize is None else normalize,
                   matryoshka_of(model_config) if matryoshka is None else matryoshka)
