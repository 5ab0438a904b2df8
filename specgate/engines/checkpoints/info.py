"""What a checkpoint holds: the facts reader.py (safetensors directories) and
gguf_info.py (GGUF files) fill in, and the error either raises.

Types only, so the two readers share them without importing each other
(reader.read_checkpoint dispatches to gguf_info).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class CheckpointError(Exception):
    """The checkpoint cannot be read (missing, corrupt, or not a checkpoint)."""


@dataclass
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str  # path of the file that holds it
    offset: int  # absolute byte offset of its data in that file

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class Quantization:
    source: str  # "mlx" (config `quantization`), "hf" (`quantization_config`), "gguf"
    description: str  # e.g. "4-bit, group size 64" or "Q4_K_M"
    bits: int | None = None
    group_size: int | None = None
    quantized_tensors: int = 0


@dataclass
class MtpInfo:
    declared: int = 0  # MTP layers the config declares
    declared_key: str | None = None  # the config key that declared them
    present: int = 0  # MTP layers found in the weights
    style: str | None = None  # "qwen" (mtp.*), "nextn" (model.layers.N), "gguf-nextn"
    prefix: str | None = None  # "mtp.", "language_model.mtp.", "model.layers.4.", ...
    tensor_names: list[str] = field(default_factory=list)
    nbytes: int = 0
    sidecar: str | None = None  # file the head came from, when not the trunk's


@dataclass
class DrafterInfo:
    kind: str  # "dflash" | "dspark" | "gemma4_assistant"
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_layers: int | None = None
    block_size: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    # What it needs of its target: the width of the target hidden states it
    # reads (from the fc / pre_projection shapes when present, else config).
    target_hidden_size: int | None = None
    markov_rank: int | None = None
    evidence: list[str] = field(default_factory=list)


@dataclass
class NormEvidence:
    """Stored RMSNorm weights of a zero-centred family (Qwen3.5/3.6, Qwen3-Next).

    Raw HF stores w (effective scale 1 + w, so values near 0) and keeps the
    conv1d in HF layout [C, 1, K]; mlx-lm's sanitize adds 1 and moves the
    conv axes ([C, K, 1]) in one go. So the stored offset the layout implies
    is 0 (hf) or 1 (mlx); a different one means a shift was doubled or lost.
    """

    layout: str  # "hf" | "mlx" | "unknown"
    conv1d_shape: tuple[int, ...] | None = None
    trunk_mean: float | None = None  # median of per-tensor means, layer norms
    trunk_tensors: int = 0
    final_norm_mean: float | None = None
    mtp_mean: float | None = None  # median over mtp.* norms (excluding q/k norms)
    mtp_tensors: int = 0


@dataclass
class GgufMeta:
    arch: str
    block_count: int | None
    nextn_predict_layers: int
    nextn_blocks: list[int]  # block indices that hold `blk.N.nextn.*`
    file_type: str | None
    tensor_types: dict[str, int]  # GGML type name -> tensor count
    kv: dict[str, object]  # the scalar `<arch>.*` keys


@dataclass
class TokenizerInfo:
    """The tokenizer files beside a safetensors checkpoint (GGUF embeds its own)."""

    vocab_files: list[str] = field(default_factory=list)  # tokenizer.json, tokenizer.model, ...
    config_file: bool = False  # tokenizer_config.json is there
    chat_template: str | None = None  # the file that holds it, None: no template
    max_token_id: int | None = None  # the highest id tokenizer.json assigns
    error: str | None = None  # why a file that is there cannot be read


@dataclass
class CheckpointInfo:
    path: str
    format: str  # "safetensors" | "gguf"
    files: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    model_type: str | None = None
    text_model_type: str | None = None
    architectures: list[str] = field(default_factory=list)
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None  # the config's compute dtype
    layer_types: dict[str, int] = field(default_factory=dict)
    sliding_window: int | None = None  # tokens a sliding_attention layer keeps (GGUF; else config's)
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    params: int = 0
    params_by_dtype: dict[str, int] = field(default_factory=dict)
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    quantization: Quantization | None = None
    mtp: MtpInfo = field(default_factory=MtpInfo)
    drafter: DrafterInfo | None = None
    norms: NormEvidence | None = None
    layout: str = "unknown"  # "hf" | "mlx" | "gguf" | "unknown"
    gguf: GgufMeta | None = None
    tokenizer: TokenizerInfo | None = None  # safetensors directories only
    errors: list[str] = field(default_factory=list)  # pieces that could not be read

    @property
    def text_config(self) -> dict:
        # Qwen3.5 and Gemma-4 nest the language model's keys.
        return self.config.get("text_config") or self.config

    @property
    def weights_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())
