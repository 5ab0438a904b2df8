"""A GGUF file as an MLX checkpoint directory, so the MLX engines serve it.

`import_gguf` writes, once per file content, what mlx-lm loads: config.json
in the Hugging Face layout of the family's mlx-lm model (archs.py), the
weights as safetensors with GGUF's quantized blocks mapped exactly onto
MLX's affine quantization where they can be (quants.py), and the tokenizer
files rebuilt from the GGUF's vocabulary (tokenizer.py). numpy, gguf and
safetensors only: no MLX here (engines/mlx_load.py loads the result).

Where: $SPECGATE_HOME/imports/<sha256 of the file>/ (engines/home.py), so
one file imported under two names, or an Ollama blob (named by its sha256),
is written once. The digest of a (path, size, mtime) is remembered in
imports/index.json, so a second start does not hash a large file again. An
import is written to a temporary directory and renamed when complete (a
crash leaves nothing that looks done), under a file lock (two processes
never import one file at once).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specgate.engines.home import imports_dir

from .archs import ARCHS, Arch, Meta, config_json, hf_name
from .quants import FLOAT_TYPES, Quantized, to_mlx
from .store import file_digest, known_digest, locked

log = logging.getLogger(__name__)

# Bumped when what an import writes changes: older imports are redone.
IMPORT_VERSION = 2  # 2: eos_token_id holds every end-of-generation id
MARKER = "specgate-import.json"
SHARD_BYTES = 2 << 30
ROPE_FREQS = "rope_freqs.weight"
# Ollama's blobs are named by their content's sha256.
_BLOB = re.compile(r"^sha256[-:]([0-9a-f]{64})$")

# progress(bytes done, bytes in all, the tensor just written)
Progress = Callable[[int, int, str], None]


class GGUFImportError(Exception):
    """A GGUF file the MLX engines cannot serve; the message says what and what to do."""


def importable(path: str | Path, home: Path | None = None) -> str | None:
    """Why the GGUF file at `path` cannot be imported for the MLX engines,
    or None if it can. A file imported before (same path, size and mtime)
    is not read again; else its key/value table and tensor infos are."""
    path = Path(path).expanduser().resolve()
    root = imports_dir(home)
    m = _BLOB.match(path.name)
    digest = m.group(1) if m else known_digest(path, root / "index.json")
    if digest is not None and _done(root / digest):
        return None
    try:
        _check(_facts(_reader(path)))
    except GGUFImportError as e:
        return str(e)
    return None


def importable_info(info) -> str | None:
    """importable() for a GGUF `specgate inspect` has read already
    (checkpoints/info.CheckpointInfo): its scalar keys and tensor names
    (the tokenizer is judged when the import runs)."""
    if info.gguf is None:
        return "not a GGUF file"
    if len(info.files) != 1:
        return "a split GGUF: merge the parts into one file (llama-gguf-split --merge)"
    try:
        _check(_Facts(info.gguf.arch, dict(info.gguf.kv), set(info.tensors), info.vocab_size or 0,
                      None, None))  # fmt: skip
    except GGUFImportError as e:
        return str(e)
    return None


def import_gguf(path: str | Path, home: Path | None = None, progress: Progress | None = None) -> Path:
    """The MLX checkpoint directory of the GGUF file at `path`, imported on
    first use (blocking: it reads and writes every weight)."""
    path = Path(path).expanduser().resolve()
    root = imports_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    m = _BLOB.match(path.name)
    digest = m.group(1) if m else file_digest(path, root / "index.json")
    dest = root / digest
    if _done(dest):
        return dest
    with locked(root / f"{digest}.lock"):
        if _done(dest):  # another process imported it while this one waited
            return dest
        for stale in root.glob(f".{digest}.tmp-*"):  # what a crashed import left
            shutil.rmtree(stale, ignore_errors=True)
        if dest.exists():  # an older importer's output
            shutil.rmtree(dest)
        tmp = root / f".{digest}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            _write(path, tmp, progress)
            (tmp / MARKER).write_text(json.dumps({"source": str(path), "sha256": digest,
                                                  "version": IMPORT_VERSION}, indent=1))  # fmt: skip
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def _done(dest: Path) -> bool:
    try:
        return json.loads((dest / MARKER).read_text()).get("version") == IMPORT_VERSION
    except (OSError, ValueError):
        return False


def _reader(path: Path):
    from specgate.engines.checkpoints.gguf_file import open_gguf

    if re.search(r"-\d{5}-of-\d{5}\.gguf$", path.name):
        raise GGUFImportError(f"{path.name} is one part of a split GGUF: merge the parts into one "
                              "file (llama-gguf-split --merge), or serve it with llamacpp")  # fmt: skip
    try:
        return open_gguf(path)
    except Exception as e:  # a corrupt file (GGUFFormatError), an unknown type, ...
        raise GGUFImportError(f"{path}: unreadable GGUF ({e})") from e


@dataclass(frozen=True)
class _Facts:
    """What deciding an import reads of a file."""

    arch: str | None
    kv: dict  # `<arch>.*` keys, the prefix stripped
    tensor_names: set[str]
    vocab_size: int
    tokenizer_model: str | None  # None: not read (inspect's facts)
    tokenizer_pre: str | None
    rope_freqs: np.ndarray | None = None  # Llama-3's RoPE factors; None: none, or not read


def _facts(reader) -> _Facts:
    def value(key: str):
        f = reader.get_field(key)
        return f.contents() if f is not None else None

    arch = value("general.architecture")
    kv = {name[len(arch) + 1:]: fld.contents() for name, fld in reader.fields.items()
          if isinstance(arch, str) and name.startswith(f"{arch}.")}  # fmt: skip
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = int(kv.get("vocab_size") or (len(tokens.data) if tokens else 0))
    model = value("tokenizer.ggml.model") if tokens else None
    freqs = next((np.array(t.data) for t in reader.tensors if t.name == ROPE_FREQS), None)
    return _Facts(arch, kv, {t.name for t in reader.tensors}, vocab, model or "",
                  value("tokenizer.ggml.pre") or "default", freqs)  # fmt: skip


def _check(facts: _Facts) -> tuple[Arch, Meta, dict[str, str]]:
    """The file's family, its keys, and each tensor's mlx-lm name; raises
    GGUFImportError for anything the import cannot map faithfully."""
    arch_name, kv, names = facts.arch, facts.kv, facts.tensor_names
    arch = ARCHS.get(arch_name)
    if arch is None:
        raise GGUFImportError(
            f"GGUF architecture {arch_name!r} cannot be imported for the MLX engines (they take "
            f"{', '.join(sorted(ARCHS))}); serve it with llamacpp")
    if facts.tokenizer_model is not None:
        from .tokenizer import PRE_TOKENIZERS

        if facts.tokenizer_model not in ("gpt2", "llama"):
            raise GGUFImportError(f"GGUF tokenizer {facts.tokenizer_model or 'missing'!r} cannot be "
                                  "rebuilt for MLX (gpt2, llama can); serve it with llamacpp")  # fmt: skip
        if facts.tokenizer_model == "gpt2" and facts.tokenizer_pre not in PRE_TOKENIZERS:
            raise GGUFImportError(f"GGUF pre-tokenizer {facts.tokenizer_pre!r} cannot be rebuilt "
                                  "for MLX; serve it with llamacpp")  # fmt: skip
    meta = Meta(kv, facts.vocab_size, names, facts.rope_freqs)
    # rope_freqs goes into config.json's rope_scaling (archs.rope_scaling), Llama's only.
    unmapped = sorted(n for n in names if hf_name(arch, n) is None
                      and not (n == ROPE_FREQS and arch.gguf == "llama"))  # fmt: skip
    if unmapped:
        shown = ", ".join(unmapped[:4]) + (f" and {len(unmapped) - 4} more" if len(unmapped) > 4 else "")
        raise GGUFImportError(f"{arch_name} GGUF tensors the MLX import cannot map: {shown}; "
                              "serve it with llamacpp")  # fmt: skip
    for key in ("attention.head_count", "attention.head_count_kv"):
        if isinstance(kv.get(key), list):
            raise GGUFImportError(f"{arch_name}.{key} differs per layer, which mlx-lm's "
                                  f"{arch.model_type} does not take; serve it with llamacpp")  # fmt: skip
    rope_dims = kv.get("rope.dimension_count")
    try:
        if rope_dims is not None and int(rope_dims) != meta.head_dim:
            raise GGUFImportError(f"RoPE over {rope_dims} of {meta.head_dim} head dimensions, which "
                                  f"mlx-lm's {arch.model_type} does not do; serve it with llamacpp")  # fmt: skip
        config = config_json(arch, meta, tied="output.weight" not in names)
        if arch.derived_head_dim and config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
            raise GGUFImportError(f"head_dim {config['head_dim']} is not hidden_size / heads, which "
                                  f"mlx-lm's {arch.model_type} assumes; serve it with llamacpp")  # fmt: skip
    except KeyError as e:
        raise GGUFImportError(f"the GGUF lacks {arch_name}.{e.args[0]}, which the import needs") from None
    except ValueError as e:
        raise GGUFImportError(f"{e} cannot be mapped to mlx-lm's {arch.model_type}; "
                              "serve it with llamacpp") from None
    return arch, meta, {n: hf_name(arch, n) for n in names}


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Llama converter, which stored Q/K rows as
    w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2): rows are
    moved whole, so quantized rows (blocks run along a row) move as they are."""
    shape = rows.shape
    return rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _write(path: Path, out: Path, progress: Progress | None) -> None:
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import save_file

    reader = _reader(path)
    arch, meta, names = _check(_facts(reader))
    heads = {"attn_q": meta.require("attention.head_count"),
             "attn_k": meta.get("attention.head_count_kv", meta.require("attention.head_count"))}  # fmt: skip
    total = sum(int(t.n_bytes) for t in reader.tensors if names[t.name] is not None)
    done = 0
    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0
    shards = 0
    quantized: dict[str, dict] = {}

    def flush():
        nonlocal shard, shard_bytes, shards
        if shard:
            shards += 1
            save_file(shard, str(out / f"model-{shards:05d}.safetensors"), metadata={"format": "mlx"})
            shard, shard_bytes = {}, 0

    for t in reader.tensors:
        name = names[t.name]
        if name is None:  # rope_freqs: config.json's rope_scaling says it
            continue
        qtype = T(t.tensor_type)
        data = t.data
        cols = int(t.shape[0])
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        stem = t.name.split(".")[-2]
        if arch.permute_qk and stem in heads:
            data = _unpermute(data.reshape(rows, -1) if rows > 1 else data.reshape(-1, 1), heads[stem])
        value = to_mlx(data, qtype, rows, cols)
        if isinstance(value, Quantized):
            module = name.rsplit(".", 1)[0]
            quantized[module] = {"group_size": value.group_size, "bits": value.bits}
            arrays = {name: value.weight, f"{module}.scales": value.scales,
                      f"{module}.biases": value.biases}  # fmt: skip
        else:
            if len(t.shape) == 1:
                value = value.reshape(cols)
            if arch.norm_shift and stem.endswith("norm"):
                # llama.cpp's converter stored Gemma's norm weights as 1 + w.
                value = (value.astype(np.float32) - arch.norm_shift).astype(value.dtype)
            arrays = {name: np.ascontiguousarray(value)}
        for k, v in arrays.items():
            shard[k] = v
            shard_bytes += v.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
        done += int(t.n_bytes)
        if progress is not None:
            progress(done, total, t.name)
    flush()

    config = config_json(arch, meta, tied="output.weight" not in names)
    if quantized:
        common = Counter((q["group_size"], q["bits"]) for q in quantized.values()).most_common(1)[0][0]
        # mlx-lm's class predicate reads a module's own entry first (its bits
        # and group size), then the defaults; a module without scales stays float.
        config["quantization"] = {"group_size": common[0], "bits": common[1], **quantized}
        config["quantization_config"] = config["quantization"]
    from .tokenizer import (
        UnsupportedTokenizer,
        eog_token_ids,
        tokenizer_files_from_metadata,
        tokenizer_metadata,
    )

    try:
        tok_meta = tokenizer_metadata(reader)
        files = tokenizer_files_from_metadata(tok_meta)
        # Every id llama.cpp ends a generation on (SmolLM2: <|endoftext|> and
        # <|im_end|>), where mlx-lm stops: config.json's eos_token_id.
        if eog := eog_token_ids(tok_meta):
            config["eos_token_id"] = eog if len(eog) > 1 else eog[0]
    except UnsupportedTokenizer as e:
        raise GGUFImportError(f"{e}; serve it with llamacpp") from None
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for filename, content in files.items():
        (out / filename).write_text(content)
    log.info("imported %s (%s, %d tensors, %d quantized) into %s", path.name, arch.gguf,
             len(reader.tensors), len(quantized), out)  # fmt: skip


__all__ = ["FLOAT_TYPES", "GGUFImportError", "import_gguf", "importable", "importable_info"]
