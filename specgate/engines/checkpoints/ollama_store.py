"""`ollama:NAME[:TAG]`: a model in Ollama's own store, served from its blob.

Ollama keeps a model as a manifest and content-addressed blobs:
`<store>/manifests/<host>/<namespace>/<name>/<tag>` (host registry.ollama.ai
and namespace library unless the name says otherwise, as Ollama's
`model.ParseName` reads `[host/][namespace/]name[:tag]`) is an OCI-style
JSON whose `layers` list the blobs; the layer of mediaType
`application/vnd.ollama.image.model` is the GGUF, at
`<store>/blobs/sha256-<hex>`. Its Go template and params layers are
Ollama's own and not read: the GGUF carries its Jinja chat template.
Written by hand (about 60 lines): Ollama publishes no Python reader of its store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .gguf_pick import SourceError, is_gguf_file

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
ENV = "OLLAMA_MODELS"


def store_candidates() -> list[Path]:
    """Where Ollama keeps models: $OLLAMA_MODELS alone when set; else the
    user's (macOS app, `ollama serve`) and the Linux service's (install.sh
    runs it as user ollama; some distributions' packages under /var/lib)."""
    if env := os.environ.get(ENV):
        return [Path(env).expanduser()]
    return [Path("~/.ollama/models").expanduser(), Path("/usr/share/ollama/.ollama/models"),
            Path("/var/lib/ollama/.ollama/models")]


def parse_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) of `[host/][namespace/]model[:tag]`."""
    if not name or "@" in name:
        raise SourceError(f"ollama:{name}: expected ollama:NAME[:TAG] (e.g. ollama:llama3.2:3b)")
    path, tag = name, DEFAULT_TAG
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:  # a host's :port comes before a slash
        path, tag = name[:colon], name[colon + 1:]
    parts = path.split("/")
    if len(parts) > 3 or not all(parts) or not tag:
        raise SourceError(f"ollama:{name}: expected ollama:[HOST/][NAMESPACE/]NAME[:TAG]")
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, model = parts
    elif len(parts) == 2:
        namespace, model = parts
    else:
        (model,) = parts
    return host, namespace, model, tag


def _child(folder: Path, name: str) -> Path | None:
    """folder/name, matched case-insensitively as Ollama does (it lowercases
    nothing on disk, but macOS's file system and its lookups ignore case)."""
    if (folder / name).exists():
        return folder / name
    try:
        return next((p for p in folder.iterdir() if p.name.lower() == name.lower()), None)
    except OSError:
        return None


def resolve_ollama(name: str) -> Path:
    """The GGUF blob of `ollama:<name>`."""
    host, namespace, model, tag = parse_name(name)
    candidates = store_candidates()
    stores = [s for s in candidates if (s / "manifests").is_dir()]
    if not stores:
        looked = ", ".join(str(s) for s in candidates)
        raise SourceError(f"ollama:{name}: no Ollama model store found (looked in {looked}); set "
                          f"{ENV} to the folder that holds Ollama's manifests/ and blobs/")
    for store in stores:
        folder = store / "manifests"
        for part in (host, namespace, model):
            folder = folder and _child(folder, part)
        manifest = folder and _child(folder, tag)
        if manifest is not None and manifest.is_file():
            return _model_blob(store, manifest, name)
    tags = sorted({t.name for s in stores if (f := s / "manifests" / host / namespace / model).is_dir()
                   for t in f.iterdir()})
    where = " or ".join(str(s) for s in stores)
    if tags:
        raise SourceError(f"ollama:{name}: {model} has no tag {tag} in {where}; its tags: "
                          f"{', '.join(tags)}")
    raise SourceError(f"ollama:{name}: no model {model} in {where} (`ollama list` shows what "
                      f"is there; `ollama pull {model}:{tag}` fetches it)")


def _model_blob(store: Path, manifest: Path, name: str) -> Path:
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"ollama:{name}: its manifest {manifest} is unreadable ({e!r})") from None
    except StopIteration:
        raise SourceError(f"ollama:{name}: its manifest {manifest} has no model layer "
                          f"({MODEL_LAYER}); specgate serves Ollama's GGUF models") from None
    blob = store / "blobs" / str(digest).replace(":", "-")
    if not blob.is_file():
        raise SourceError(f"ollama:{name}: its model blob {blob} is missing (an interrupted pull? "
                          f"`ollama pull` it again)")
    if not is_gguf_file(blob):
        raise SourceError(f"ollama:{name}: its model blob {blob} is not a GGUF file (or is "
                          "unreadable by this user)")
    return blob
