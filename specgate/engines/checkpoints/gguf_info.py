"""What a GGUF file holds, from its key/value table and tensor infos.

llama.cpp's converter (`_QwenMtpMixin`) writes an MTP head as
`<arch>.nextn_predict_layers` plus ordinary blocks at the end whose extra
tensors are `blk.{i}.nextn.*` (eh_proj, enorm, hnorm, shared_head_norm):
`block_count` counts those blocks too, so the head sits at
[block_count - nextn_predict_layers, block_count).
"""

from __future__ import annotations

import re
from pathlib import Path

from .info import (
    CheckpointError,
    CheckpointInfo,
    GgufMeta,
    MtpInfo,
    Quantization,
    TensorMeta,
    TokenizerInfo,
)

_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")
# Sliding-window families as llama.cpp loads them (src/models/<arch>.cpp):
# the layer pattern its loader assumes when the GGUF has no
# `<arch>.attention.sliding_window_pattern` (every n-th layer full, the rest
# windowed), and the window it assumes when the file names none. gemma3 and
# llama4 attend fully unless the file names a window; gemma4's files always
# carry the per-layer array (its loader requires it), the 6 is never used.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma4": 6, "cohere2": 4,
                "gpt-oss": 2, "exaone4": 4, "llama4": 4}
_SWA_DEFAULT_WINDOW = {"gemma2": 4096, "exaone4": 4096, "llama4": 8192}
_SWA_NEEDS_KEY = ("gemma3", "llama4")
# Split GGUFs: name-00001-of-00003.gguf; the first shard holds the keys.
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _gguf_files(root: Path) -> list[Path]:
    if root.is_file():
        m = _SHARD.search(root.name)
        if not m:
            return [root]
        stem = root.name[: m.start()]
        return sorted(root.parent.glob(f"{stem}-*-of-{m.group(2)}.gguf"))
    files = sorted(root.glob("*.gguf"))
    # MTP-only sidecars (`convert_hf_to_gguf.py --mtp`) are not the model.
    main = [f for f in files if not f.name.startswith("mtp-")]
    if not main:
        raise CheckpointError(f"{root} holds only MTP sidecar GGUFs (mtp-*.gguf), no model")
    stems = {f.name[: m.start()] if (m := _SHARD.search(f.name)) else f.name for f in main}
    if len(stems) != 1:
        names = ", ".join(f.name for f in main) or "none"
        raise CheckpointError(f"{root} holds several GGUF models ({names}); name the .gguf file")
    return main


def read_gguf(path: Path) -> CheckpointInfo:
    from gguf import LlamaFileType

    from .gguf_file import open_gguf

    files = _gguf_files(path)
    try:
        readers = [open_gguf(f) for f in files]
    except Exception as e:  # a corrupt file (GGUFFormatError), an unknown type, ...
        raise CheckpointError(f"{path}: unreadable GGUF ({e})") from e

    def value(key: str):
        f = readers[0].get_field(key)
        return f.contents() if f is not None else None

    arch = value("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(f"{path}: GGUF without general.architecture")
    info = CheckpointInfo(path=str(path), format="gguf", files=[str(f) for f in files], layout="gguf")
    info.model_type = arch
    kv = {}
    for r in readers[:1]:
        for name, fld in r.fields.items():
            if name.startswith(f"{arch}.") and len(fld.types) == 1:  # scalars only
                kv[name[len(arch) + 1:]] = fld.contents()
    types: dict[str, int] = {}
    for f, r in zip(files, readers, strict=True):
        for t in r.tensors:
            tname = t.tensor_type.name
            types[tname] = types.get(tname, 0) + 1
            # GGUF lists dims innermost first; keep them as the file has them.
            info.tensors[t.name] = TensorMeta(tname, tuple(int(d) for d in t.shape), int(t.n_bytes),
                                              str(f), int(t.data_offset))
            info.bytes_by_dtype[tname] = info.bytes_by_dtype.get(tname, 0) + int(t.n_bytes)
            info.params_by_dtype[tname] = info.params_by_dtype.get(tname, 0) + int(t.n_elements)
            info.params += int(t.n_elements)

    block_count = kv.get("block_count")
    nextn = int(kv.get("nextn_predict_layers") or 0)
    nextn_blocks = sorted({int(m.group(1)) for k in info.tensors if (m := _NEXTN.match(k))})
    ftype = value("general.file_type")
    try:
        ftype_name = LlamaFileType(ftype).name if ftype is not None else None
    except ValueError:
        ftype_name = f"file_type {ftype}"
    info.gguf = GgufMeta(arch, block_count, nextn, nextn_blocks, ftype_name, types, kv)

    # llama.cpp reads the vocabulary from the file itself; without it the model fails to load.
    info.tokenizer = TokenizerInfo(
        vocab_files=["tokenizer.ggml.tokens"] if readers[0].get_field("tokenizer.ggml.tokens") else [],
        chat_template="tokenizer.chat_template" if value("tokenizer.chat_template") else None)
    info.hidden_size = kv.get("embedding_length")
    info.vocab_size = kv.get("vocab_size") or _vocab_from_tokens(readers[0])
    if block_count is not None:
        info.num_hidden_layers = block_count - nextn
    info.num_attention_heads = kv.get("attention.head_count")
    info.num_key_value_heads = kv.get("attention.head_count_kv")
    # llama.cpp's default head size when the file has no key_length: n_embd / n_head.
    heads = info.num_attention_heads
    info.head_dim = kv.get("attention.key_length") or (
        info.hidden_size // heads if isinstance(heads, int) and heads and info.hidden_size else None)
    if info.num_hidden_layers:
        interval = kv.get("full_attention_interval")
        windowed = _sliding_layers(arch, kv, readers[0], info.num_hidden_layers)
        if interval:
            full = info.num_hidden_layers // interval
            info.layer_types = {"linear_attention": info.num_hidden_layers - full, "full_attention": full}
        elif windowed:
            window = kv.get("attention.sliding_window") or _SWA_DEFAULT_WINDOW.get(arch)
            info.sliding_window = int(window) if window else None  # None: llama.cpp refuses it
            info.layer_types = {"sliding_attention": windowed,
                                "full_attention": info.num_hidden_layers - windowed}
        else:
            info.layer_types = {"full_attention": info.num_hidden_layers}

    quantized = {t: n for t, n in types.items() if t not in ("F32", "F16", "BF16", "F64")}
    if quantized:
        info.quantization = Quantization("gguf", ftype_name or ", ".join(sorted(quantized)),
                                         quantized_tensors=sum(quantized.values()))

    heads = [k for k in info.tensors if _NEXTN.match(k) or any(
        k.startswith(f"blk.{b}.") for b in nextn_blocks)]
    info.mtp = MtpInfo(
        declared=nextn, declared_key=f"{arch}.nextn_predict_layers" if nextn else None,
        present=len(nextn_blocks), style="gguf-nextn" if nextn_blocks else None,
        prefix=f"blk.{nextn_blocks[0]}." if nextn_blocks else None,
        tensor_names=sorted(heads), nbytes=sum(info.tensors[k].nbytes for k in heads),
    )
    return info


def _sliding_layers(arch: str, kv: dict, reader, layers: int) -> int:
    """How many of the layers attend to a sliding window, as llama.cpp's
    loader decides it (llama_hparams::set_swa_pattern): the file's
    `<arch>.attention.sliding_window_pattern` (a bool per layer, or a period
    n: layer i is windowed unless i % n == n - 1), else the family's period."""
    if arch not in _SWA_PATTERN:
        return 0
    window = kv.get("attention.sliding_window")
    if arch in _SWA_NEEDS_KEY and not window:
        return 0
    field = reader.get_field(f"{arch}.attention.sliding_window_pattern")
    if field is not None and len(field.types) > 1:  # an array: one bool per layer
        return sum(1 for v in field.contents()[:layers] if v)
    n = int(field.contents()) if field is not None else _SWA_PATTERN[arch]
    return layers if n == 0 else sum(1 for i in range(layers) if i % n < n - 1)


def _vocab_from_tokens(reader) -> int | None:
    f = reader.get_field("tokenizer.ggml.tokens")
    return len(f.data) if f is not None else None
