"""Which GGUF file a folder or repo means: by the file's magic, and among
several by the quantization in their names (llama.cpp's `-hf org/name:QUANT`
convention), a split model's shards counting as one. Shared by the model
stores (sources.py, ollama_store.py, lmstudio_store.py) and `specgate pull`.
"""

from __future__ import annotations

import re
from pathlib import Path

GGUF_MAGIC = b"GGUF"
# Split GGUFs: name-00001-of-00003.gguf (llama.cpp's gguf-split naming).
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class SourceError(ValueError):
    """A store name that names nothing usable; the message says where it looked."""


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:  # a directory, missing, unreadable
        return False


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file's name carries (Q4_K_M, IQ2_XS, F16, ...)."""
    m = re.search(r"(?<![A-Za-z0-9])((?:I?Q\d+(?:_[A-Z0-9]+)*)|F16|BF16|F32)(?![A-Za-z0-9])",
                  Path(_SHARD.sub(".gguf", filename)).stem, re.IGNORECASE)
    return m.group(1).upper() if m else None


def _matches(quant: str, rel: str) -> bool:
    # Q4_K must not take Q4_K_M: no letter, digit or underscore may follow.
    pattern = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(pattern, rel, re.IGNORECASE) is not None


def _models(files: list[str]) -> dict[str, list[str]]:
    """GGUF files grouped into models: a split model's shards are one, first
    shard first. Vision projectors (mmproj) and MTP sidecars are not models."""
    groups: dict[str, list[str]] = {}
    for rel in sorted(files):
        base = rel.rsplit("/", 1)[-1].lower()
        if base.startswith(("mmproj", "mtp-")):
            continue
        groups.setdefault(_SHARD.sub("", rel), []).append(rel)
    return groups


def pick_gguf(files: list[str], quant: str | None, where: str, form: str) -> list[str]:
    """The files (one, or a split model's shards) of the one GGUF model among
    `files` (paths relative to a folder or repo), picked by `quant` when
    given. `form` is how to name it with a quant (`form:QUANT`) in errors."""
    models = _models(files)
    if quant:
        models = {k: v for k, v in models.items() if _matches(quant, k)}
    if len(models) == 1:
        return next(iter(models.values()))
    everything = _models(files)
    listing = ", ".join(everything) or "none"
    quants = sorted({q for k in everything if (q := quant_of(k))})
    pick = (f"; pick one with {' or '.join(f'{form}:{q}' for q in quants[:4])}"
            f"{' ...' if len(quants) > 4 else ''}") if quants else ""
    if quant and not models:
        raise SourceError(f"{where} has no {quant} GGUF; it has: {listing}{pick}")
    if quant:
        raise SourceError(f"{where}: several GGUF files match {quant}: {', '.join(models)}")
    if not models:
        raise SourceError(f"{where} holds no GGUF model")
    raise SourceError(f"{where} holds several GGUF models ({listing}){pick}")
