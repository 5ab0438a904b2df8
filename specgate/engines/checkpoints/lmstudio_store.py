"""`lmstudio:PUBLISHER/REPO[/FILE.gguf][:QUANT]`: a model in LM Studio's folder.

LM Studio downloads into `<models>/<publisher>/<repo>/` (the Hugging Face
org and repo): GGUF files, or an MLX model (config.json + safetensors).
The folder is $LMSTUDIO_MODELS (ours: LM Studio lets users move it), else
`~/.lmstudio/models`, else the older `~/.cache/lm-studio/models`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .gguf_pick import SourceError, is_gguf_file, pick_gguf

ENV = "LMSTUDIO_MODELS"
_NAME = re.compile(r"^(?P<repo>[^/:]+/[^/:]+)(?:/(?P<file>[^/:]+\.gguf))?(?::(?P<quant>[\w.-]+))?$",
                   re.IGNORECASE)


def folder_candidates() -> list[Path]:
    if env := os.environ.get(ENV):
        return [Path(env).expanduser()]
    return [Path("~/.lmstudio/models").expanduser(), Path("~/.cache/lm-studio/models").expanduser()]


def resolve_lmstudio(name: str) -> Path:
    """The GGUF file, or the MLX model's folder, `lmstudio:<name>` names."""
    m = _NAME.match(name)
    if not m:
        raise SourceError(f"lmstudio:{name}: expected lmstudio:PUBLISHER/REPO, "
                          "lmstudio:PUBLISHER/REPO/FILE.gguf or lmstudio:PUBLISHER/REPO:QUANT")
    candidates = folder_candidates()
    roots = [c for c in candidates if c.is_dir()]
    if not roots:
        raise SourceError(f"lmstudio:{name}: no LM Studio models folder found (looked in "
                          f"{', '.join(map(str, candidates))}); set {ENV} to it")
    repo = next((r / m["repo"] for r in roots if (r / m["repo"]).is_dir()), None)
    if repo is None:
        there = sorted(f"{p.parent.name}/{p.name}" for r in roots for p in r.glob("*/*") if p.is_dir())
        raise SourceError(f"lmstudio:{name}: no {m['repo']} in {' or '.join(map(str, roots))}; "
                          f"there: {', '.join(there) or 'nothing'}")
    if m["file"]:
        path = repo / m["file"]
        if not is_gguf_file(path):
            raise SourceError(f"lmstudio:{name}: {path} is {'not a GGUF file' if path.exists() else 'missing'}")
        return path
    ggufs = sorted(p.name for p in repo.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if not ggufs and not m["quant"]:
        if (repo / "config.json").is_file() and any(repo.glob("*.safetensors")):
            return repo  # an MLX model: the folder, as a checkpoint directory
        raise SourceError(f"lmstudio:{name}: {repo} holds neither a GGUF file nor an MLX model "
                          "(config.json and .safetensors)")
    return repo / pick_gguf(ggufs, m["quant"], f"lmstudio:{name} ({repo})", f"lmstudio:{m['repo']}")[0]
