"""What a checkpoint holds, read without loading its weights.

Everything here comes from config.json and the safetensors headers (the
8-byte little-endian length plus a JSON table of names, dtypes, shapes and
offsets), so a 100 GB checkpoint is read in milliseconds. The only tensor
data ever read are a few 1-D norm weights, which carry the evidence of the
zero-centred norm convention (see info.NormEvidence). GGUF files are read
in gguf_info.py into the same `CheckpointInfo` (info.py: the types both fill).

This module only gathers facts; inspect.py judges them.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from .gguf_info import read_gguf
from .gguf_pick import is_gguf_file
from .info import (
    CheckpointError,
    CheckpointInfo,
    DrafterInfo,
    MtpInfo,
    NormEvidence,
    Quantization,
    TensorMeta,
    TokenizerInfo,
)

# MTP heads that conversions write beside the trunk instead of into it.
SIDECAR_FILES = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")

# A corrupt length field must not make us read gigabytes as JSON.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> bytes per element (for parameter counts; the byte
# totals themselves come from the header's data offsets).
_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4,
    "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1,
}

# `mtp.*` at the top level (Qwen's release), under mlx-lm's renamed prefix,
# or under the text model's prefix.
_MTP_PREFIX = re.compile(r"^((?:model\.language_model\.|language_model\.|model\.)?mtp\.)")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")
# DeepSeek-V3 / GLM style: the nextn layer is `model.layers.{num_hidden_layers}`.
_NEXTN_MARK = re.compile(r"^model\.layers\.(\d+)\.(eh_proj|enorm|hnorm)\.")


# ---------------------------------------------------------------- safetensors


def read_safetensors_header(path: Path) -> dict[str, TensorMeta]:
    """Names, dtypes, shapes and offsets from the header alone."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path.name}: too short to be safetensors")
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path.name}: header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: unreadable safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is not a JSON object")
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            meta = TensorMeta(entry["dtype"], tuple(entry["shape"]), end - begin, str(path), base + begin)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path.name}: bad header entry for {name}") from e
        if base + end > size:
            raise CheckpointError(f"{path.name}: {name} runs past the end of the file (truncated?)")
        out[name] = meta
    return out


def read_vector(meta: TensorMeta) -> np.ndarray | None:
    """The values of a small tensor as float32 (None for non-float dtypes)."""
    kinds = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}
    if meta.dtype not in kinds:
        return None
    with open(meta.file, "rb") as f:
        f.seek(meta.offset)
        data = np.frombuffer(f.read(meta.nbytes), dtype=kinds[meta.dtype])
    if meta.dtype == "BF16":  # numpy has no bfloat16: widen the bits
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def _weight_files(root: Path, errors: list[str]) -> list[Path]:
    index = root / "model.safetensors.index.json"
    names: set[str] = set()
    if index.exists():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"model.safetensors.index.json is unreadable ({e})") from e
        for missing in sorted(n for n in names if not (root / n).exists()):
            errors.append(f"the index names shard {missing}, which is missing (incomplete download?)")
    # Shards the index does not list still count (older conversions), but
    # never the sidecars: they are read separately, as MTP heads.
    names |= {p.name for p in root.glob("*.safetensors")}
    names -= set(SIDECAR_FILES)
    return [root / n for n in sorted(names) if (root / n).exists()]


def _read_sidecar(root: Path, tensors: dict[str, TensorMeta], mtp: MtpInfo) -> None:
    for rel in SIDECAR_FILES:
        path = root / rel
        if not path.exists():
            continue
        for name, meta in read_safetensors_header(path).items():
            # A sidecar holds only the head; some write names without `mtp.`.
            key = name if _MTP_PREFIX.match(name) else f"mtp.{name}"
            tensors.setdefault(key, meta)
        mtp.sidecar = rel


# ---------------------------------------------------------------- config facts


def _layer_types(tc: dict) -> dict[str, int]:
    n = tc.get("num_hidden_layers") or 0
    types = tc.get("layer_types")
    if not types and "linear_num_value_heads" in tc:
        # Qwen3-Next's flat config has no list: every interval-th layer is full.
        interval = tc.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if not types:
        types = ["full_attention"] * n
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    return counts


def _declared_mtp(cfg: dict, tc: dict) -> tuple[int, str | None]:
    # vLLM reads mtp_num_hidden_layers for Qwen3.5 and num_nextn_predict_layers
    # for Qwen3-Next and DeepSeek; accept either, from either level.
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        for where in (tc, cfg):
            if isinstance(where.get(key), int):
                return where[key], key
    return 0, None


def _quantization(cfg: dict, tensors: dict[str, TensorMeta]) -> Quantization | None:
    n_quant = sum(1 for k in tensors if k.endswith(".scales"))
    q = cfg.get("quantization") or cfg.get("text_config", {}).get("quantization")
    if isinstance(q, dict):
        bits, gs = q.get("bits"), q.get("group_size")
        mode = q.get("mode", "affine")
        desc = f"{bits}-bit, group size {gs}" + ("" if mode == "affine" else f", {mode}")
        return Quantization("mlx", desc, bits, gs, n_quant)
    hq = cfg.get("quantization_config")
    if isinstance(hq, dict):
        method = hq.get("quant_method", "unknown")
        return Quantization("hf", f"{method} (quantization_config)", hq.get("bits"), hq.get("group_size"))
    if n_quant:
        return Quantization("mlx", "quantized tensors (.scales) without a quantization config",
                            quantized_tensors=n_quant)
    return None


def _quant_bits(cfg_q: dict | None, module: str) -> int | None:
    """Bits of one mlx-quantized module: per-module override, else global."""
    if not cfg_q:
        return None
    override = cfg_q.get(module)
    if isinstance(override, dict) and "bits" in override:
        return override["bits"]
    return cfg_q.get("bits")


def _count_params(info: CheckpointInfo) -> None:
    cfg_q = info.config.get("quantization") if isinstance(info.config.get("quantization"), dict) else None
    for name, meta in info.tensors.items():
        info.bytes_by_dtype[meta.dtype] = info.bytes_by_dtype.get(meta.dtype, 0) + meta.nbytes
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in info.tensors:
            continue  # quantization metadata, not parameters
        n = meta.numel
        module = name.rsplit(".", 1)[0]
        if meta.dtype == "U32" and module + ".scales" in info.tensors:
            bits = _quant_bits(cfg_q, module)
            n = n * 32 // bits if bits else n  # packed: 32 / bits values per word
        info.params += n
        info.params_by_dtype[meta.dtype] = info.params_by_dtype.get(meta.dtype, 0) + n


# ---------------------------------------------------------------- tokenizer


# Files that hold a vocabulary, in the formats transformers' AutoTokenizer reads
# (fast tokenizer, sentencepiece, BPE vocab + merges, tiktoken). Without any,
# transformers still builds a tokenizer, an empty one that encodes every text
# to no tokens.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# Where transformers looks for a chat template besides tokenizer_config.json.
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def read_tokenizer(root: Path) -> TokenizerInfo:
    """What tokenizer a checkpoint directory has, read without building it."""
    t = TokenizerInfo()
    t.vocab_files = [n for n in TOKENIZER_VOCAB_FILES if (root / n).is_file()]
    t.vocab_files += sorted(p.name for p in root.glob("*.tiktoken"))
    config_path = root / "tokenizer_config.json"
    t.config_file = config_path.is_file()
    try:
        if t.config_file:
            tcfg = json.loads(config_path.read_text(encoding="utf-8"))
            if isinstance(tcfg, dict) and tcfg.get("chat_template"):
                t.chat_template = "tokenizer_config.json"
        if (root / "tokenizer.json").is_file():
            t.max_token_id = _max_token_id(json.loads((root / "tokenizer.json").read_bytes()))
    except (OSError, ValueError) as e:
        t.error = f"{e.__class__.__name__}: {e}"
    if t.chat_template is None:
        t.chat_template = next((n for n in _CHAT_TEMPLATE_FILES if (root / n).is_file()), None)
    return t


def _max_token_id(tok: dict) -> int | None:
    vocab = (tok.get("model") or {}).get("vocab") if isinstance(tok, dict) else None
    ids = []
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids = [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
        ids = [len(vocab) - 1] if vocab else []
    ids += [a["id"] for a in tok.get("added_tokens") or [] if isinstance(a.get("id"), int)]
    return max(ids) if ids else None


# ---------------------------------------------------------------- MTP and drafters


def _find_mtp(info: CheckpointInfo) -> None:
    mtp = info.mtp
    names = [k for k in info.tensors if _MTP_PREFIX.match(k)]
    if names:
        mtp.style = "qwen"
        mtp.prefix = _MTP_PREFIX.match(names[0]).group(1)
        mtp.present = len({m.group(1) for k in names if (m := _MTP_LAYER.search(k))})
    else:
        n = info.num_hidden_layers or 0
        nextn = sorted({int(m.group(1)) for k in info.tensors if (m := _NEXTN_MARK.match(k))})
        nextn = [i for i in nextn if i >= n]
        if nextn:
            mtp.style = "nextn"
            mtp.prefix = f"model.layers.{nextn[0]}."
            mtp.present = len(nextn)
            wanted = tuple(f"model.layers.{i}." for i in nextn)
            names = [k for k in info.tensors if k.startswith(wanted)]
    mtp.tensor_names = sorted(names)
    mtp.nbytes = sum(info.tensors[k].nbytes for k in names)


_DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "num_anchors")
_DSPARK_TENSORS = re.compile(r"(^|\.)(markov_w1|markov_w2|confidence_head)\.")


def _find_drafter(info: CheckpointInfo) -> DrafterInfo | None:
    cfg = info.config
    dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}

    def key(k: str):
        return dcfg.get(k, cfg.get(k))

    if info.model_type == "gemma4_assistant":
        d = DrafterInfo("gemma4_assistant", evidence=["model_type gemma4_assistant"])
        d.target_hidden_size = cfg.get("backbone_hidden_size", 1536)  # transformers' default
        pre = info.tensors.get("pre_projection.weight")
        if pre is not None and len(pre.shape) == 2:
            d.evidence.append(f"pre_projection {list(pre.shape)}")
    else:
        dspark_keys = [k for k in _DSPARK_KEYS if key(k) is not None]
        dspark_tensors = [k for k in info.tensors if _DSPARK_TENSORS.search(k)]
        if dspark_keys or dspark_tensors:
            # DeepSpec's own dflash_* checkpoints are this class with
            # markov_rank 0 (DSpark alignment), so these keys decide first.
            d = DrafterInfo("dspark", markov_rank=key("markov_rank"))
            d.evidence += [f"config key {k}" for k in dspark_keys]
            d.evidence += [f"tensor {k}" for k in dspark_tensors[:3]]
        elif dcfg or any("DFlash" in a for a in info.architectures):
            d = DrafterInfo("dflash", evidence=["dflash_config" if dcfg else "architectures"])
        else:
            return None
        d.target_layer_ids = key("target_layer_ids")
        d.num_target_layers = key("num_target_layers")
        fc = next((m for k, m in info.tensors.items() if k in ("fc.weight", "model.fc.weight")), None)
        n_feat = len(d.target_layer_ids or [])
        # fc fuses the n target layers' hidden states: its width says which
        # target it was trained on. No usable fc leaves this None (a problem).
        if fc is not None and len(fc.shape) == 2 and n_feat and fc.shape[1] % n_feat == 0:
            d.target_hidden_size = fc.shape[1] // n_feat
            d.evidence.append(f"fc {list(fc.shape)} over {n_feat} target layers")
    d.hidden_size = info.hidden_size
    d.vocab_size = info.vocab_size
    d.num_layers = info.num_hidden_layers
    d.block_size = key("block_size") if d.kind != "gemma4_assistant" else None
    return d


# ---------------------------------------------------------------- norms


_LAYER_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight")
_MTP_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight") + _LAYER_NORMS
_FINAL_NORMS = ("model.language_model.norm.weight", "model.norm.weight", "language_model.model.norm.weight")


def _mean(meta: TensorMeta) -> float | None:
    if len(meta.shape) != 1:
        return None
    v = read_vector(meta)
    return None if v is None or v.size == 0 else float(v.mean())


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _layout(info: CheckpointInfo) -> tuple[str, tuple[int, ...] | None]:
    conv = next((m for k, m in info.tensors.items() if k.endswith("conv1d.weight")), None)
    if conv is not None and len(conv.shape) == 3:
        # HF Conv1d is [C, 1, K]; mlx-lm's sanitize moves it to [C, K, 1].
        return ("mlx" if conv.shape[-1] == 1 else "hf"), conv.shape
    names = info.tensors.keys()
    if (info.quantization and info.quantization.source == "mlx") or any(
        k.startswith("language_model.model.") or ".switch_mlp." in k for k in names
    ):
        return "mlx", None
    return "hf", None


def _norm_evidence(info: CheckpointInfo, layout: str, conv_shape) -> NormEvidence:
    mtp_names = set(info.mtp.tensor_names)
    ev = NormEvidence(layout, conv_shape)
    trunk = [m for k, m in info.tensors.items() if k.endswith(_LAYER_NORMS) and k not in mtp_names]
    # A few hundred vectors of hidden size at most: kilobytes to megabytes.
    trunk_means = [x for m in trunk[:256] if (x := _mean(m)) is not None]
    ev.trunk_mean, ev.trunk_tensors = _median(trunk_means), len(trunk_means)
    final = next((info.tensors[k] for k in _FINAL_NORMS if k in info.tensors), None)
    ev.final_norm_mean = _mean(final) if final is not None else None
    if info.mtp.style == "qwen":
        prefix = info.mtp.prefix or "mtp."
        mtp = [info.tensors[k] for k in mtp_names
               if k[len(prefix):].endswith(_MTP_NORMS) and ".linear_attn." not in k]
        mtp_means = [x for m in mtp if (x := _mean(m)) is not None]
        ev.mtp_mean, ev.mtp_tensors = _median(mtp_means), len(mtp_means)
    return ev


# ---------------------------------------------------------------- entry point


def read_checkpoint(path: str | Path) -> CheckpointInfo:
    """Read a checkpoint directory (safetensors) or a .gguf file / directory."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist")
    ggufs = sorted(root.glob("*.gguf")) if root.is_dir() else []
    gguf_dir = bool(ggufs) and not (root / "config.json").exists()
    # By magic as well as name: Ollama's blobs (sha256-<hex>) have no suffix.
    if (root.is_file() and (root.suffix == ".gguf" or is_gguf_file(root))) or gguf_dir:
        return read_gguf(root)
    if root.is_file():
        raise CheckpointError(f"{root} is a file; give a checkpoint directory or a .gguf file")
    return _read_safetensors_dir(root)


def _read_safetensors_dir(root: Path) -> CheckpointInfo:
    cfg_path = root / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{root} has no config.json (and no .gguf file)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"config.json is unreadable ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError("config.json is not a JSON object")

    info = CheckpointInfo(path=str(root), format="safetensors", config=cfg)
    tc = info.text_config
    info.model_type = cfg.get("model_type")
    info.text_model_type = tc.get("model_type") if tc is not cfg else None
    info.architectures = list(cfg.get("architectures") or [])
    info.hidden_size = tc.get("hidden_size")
    info.vocab_size = tc.get("vocab_size", cfg.get("vocab_size"))
    info.num_hidden_layers = tc.get("num_hidden_layers")
    info.num_attention_heads = tc.get("num_attention_heads")
    info.num_key_value_heads = tc.get("num_key_value_heads", info.num_attention_heads)
    if info.hidden_size and info.num_attention_heads:
        info.head_dim = tc.get("head_dim") or info.hidden_size // info.num_attention_heads
    info.dtype = tc.get("dtype") or tc.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    info.layer_types = _layer_types(tc)
    info.mtp.declared, info.mtp.declared_key = _declared_mtp(cfg, tc)

    files = _weight_files(root, info.errors)
    if not files and not any((root / s).exists() for s in SIDECAR_FILES):
        raise CheckpointError(f"{root} holds no .safetensors weights")
    for f in files:
        for name, meta in read_safetensors_header(f).items():
            info.tensors.setdefault(name, meta)
    _read_sidecar(root, info.tensors, info.mtp)
    info.files = [str(f) for f in files] + [str(root / s) for s in SIDECAR_FILES if (root / s).exists()]

    info.quantization = _quantization(cfg, info.tensors)
    _count_params(info)
    _find_mtp(info)
    info.drafter = _find_drafter(info)
    info.layout, conv_shape = _layout(info)
    info.norms = _norm_evidence(info, info.layout, conv_shape)
    info.tokenizer = read_tokenizer(root)
    return info
