"""What a configured model is, read from its checkpoint without loading it:
format, family, parameters, quantization, size on disk, when it changed, a
digest, its context length and chat template. Ollama's model listing and
`/api/show` (gateway/api/ollama_api.py) answer from it.

Read once per model path, on a thread (a checkpoint's headers, a GGUF's
metadata), and kept: a checkpoint changed on disk under the same path is
read again after a restart. Nothing in a card names a file path: keys that
are not admins do not learn where the models live.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specgate.engines.checkpoints import builtin
from specgate.engines.checkpoints.info import CheckpointError, CheckpointInfo
from specgate.engines.checkpoints.inspect import UsageError, resolve_local
from specgate.engines.checkpoints.reader import read_checkpoint
from specgate.gateway.config import ModelConfig

_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class ModelCard:
    format: str = ""  # "safetensors" | "gguf"; "" when the checkpoint cannot be read here
    family: str = ""  # the model type (config.json) or GGUF architecture
    parameters: int = 0  # 0: not known
    quantization: str = ""  # "Q4_K_M", "4-bit, group size 64", "BF16", ...
    size: int = 0  # bytes of its files on disk
    modified: float = 0.0  # the newest file's mtime (epoch seconds)
    digest: str = ""  # sha256 of the files' names, sizes and mtimes: changes when they do
    context_length: int | None = None  # what the checkpoint declares
    chat_template: str | None = None  # a safetensors checkpoint's (a GGUF's: from its engine)

    @property
    def parameter_size(self) -> str:
        """As Ollama writes it: "7.6B", "494.03M"."""
        n = self.parameters
        if n >= 1e9:
            return f"{n / 1e9:.1f}B"
        if n >= 1e6:
            return f"{n / 1e6:.2f}M"
        return f"{n / 1e3:.2f}K" if n else ""


def read_card(mc: ModelConfig) -> ModelCard:
    """Blocking. An empty card for a checkpoint not on this machine (a hub
    repo not downloaded, the demo's GGUF not exported yet) or unreadable."""
    try:
        # No GGUF export here: a listing must not start one.
        info = read_checkpoint(resolve_local(mc.path, builtin.builtin_path))
    except (UsageError, CheckpointError, OSError, ValueError):
        return ModelCard()
    files = [Path(f) for f in info.files]
    stats = [(f.name, f.stat()) for f in files if f.exists()]
    fingerprint = json.dumps([(name, s.st_size, s.st_mtime_ns) for name, s in stats])
    return ModelCard(
        format=info.format,
        family=(info.gguf.arch if info.gguf else info.model_type) or "",
        parameters=info.params,
        quantization=_quantization(info),
        size=sum(s.st_size for _, s in stats),
        modified=max((s.st_mtime for _, s in stats), default=0.0),
        digest=hashlib.sha256(fingerprint.encode()).hexdigest(),
        context_length=_context_length(info),
        chat_template=_chat_template(info),
    )


def _quantization(info: CheckpointInfo) -> str:
    if info.gguf is not None and info.gguf.file_type:
        return info.gguf.file_type.removeprefix("MOSTLY_").removeprefix("ALL_")
    if info.quantization is not None:
        return info.quantization.description
    return _DTYPES.get(str(info.dtype), str(info.dtype or "").upper())


def _context_length(info: CheckpointInfo) -> int | None:
    value = (info.gguf.kv.get("context_length") if info.gguf
             else info.text_config.get("max_position_embeddings"))  # fmt: skip
    return value if isinstance(value, int) and value > 0 else None


def _chat_template(info: CheckpointInfo) -> str | None:
    """The template text of a safetensors checkpoint, from the file the
    reader found it in; transformers' "tool_use" template where there are
    several, as the engines pick."""
    held = info.tokenizer.chat_template if info.tokenizer else None
    if held is None or info.format != "safetensors":
        return None
    path = Path(info.path) / held
    try:
        if path.suffix == ".jinja":
            return path.read_text(encoding="utf-8")
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use") or named.get("default")
    return template if isinstance(template, str) else None


class ModelCards:
    """Each model path's card, read on first use."""

    def __init__(self) -> None:
        self._cards: dict[str, asyncio.Future] = {}

    async def of(self, mc: ModelConfig) -> ModelCard:
        card = self._cards.get(mc.path)
        if card is None:  # one read per path, however many requests ask at once
            card = self._cards[mc.path] = asyncio.ensure_future(asyncio.to_thread(read_card, mc))
        return await asyncio.shield(card)
