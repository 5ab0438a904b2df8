"""What a model takes in memory: estimated before it loads (from what
`specgate inspect` reads), measured once it has."""

from __future__ import annotations

from dataclasses import dataclass, field

from specgate.engines import registry
from specgate.engines.checkpoints.inspect import UsageError, inspect_checkpoint
from specgate.engines.forwards.quantized_kv import bytes_per_value
from specgate.engines.precision import upcast_applies
from specgate.gateway.config import ModelConfig

# An MLX model's KV cache grows with what it holds; with no max_context
# configured, the reserve is this many tokens (one long agent session), not
# the model's whole window times max_concurrent (which would refuse most
# large models outright).
MLX_KV_RESERVE_TOKENS = 32768
# An embedding or rerank model keeps no cache: its reserve is one forward's
# keys and values, at most this many padded tokens (engines/embedding/
# embedder.py's GPU default; a CPU's forwards are smaller).
EMBEDDING_FORWARD_TOKENS = 16384
# Half-precision weights in a checkpoint report, as safetensors and MLX name them.
_HALF_DTYPES = ("BF16", "F16", "bfloat16", "float16")


@dataclass(frozen=True)
class Footprint:
    weights: int  # the target's weights (per llama-server process, for a GGUF)
    drafter: int = 0  # a separate drafter's weights
    kv_reserve: int = 0  # KV cache and recurrent state for the configured load
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def total(self) -> int:
        return self.weights + self.drafter + self.kv_reserve

    def describe(self) -> str:
        parts = [f"weights {gib(self.weights)}"]
        if self.drafter:
            parts.append(f"drafter {gib(self.drafter)}")
        parts.append(f"KV reserve {gib(self.kv_reserve)}")
        return f"{gib(self.total)} ({', '.join(parts)})"


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def estimate(mc: ModelConfig) -> Footprint | None:
    """Before loading: None when the checkpoint is not on this machine yet
    (a hub repo still to download) or cannot be read here (loading says why)."""
    from specgate.gateway.serving.builtins import builtin_path

    try:
        report = inspect_checkpoint(mc.path, builtin=builtin_path)
    except UsageError:
        return None
    memory = report.memory
    if memory is None:
        return None
    notes = list(memory.assumptions)
    drafter = 0
    if mc.drafter:
        try:
            drafter_report = inspect_checkpoint(mc.drafter, builtin=builtin_path)
            drafter = drafter_report.memory.weights_bytes if drafter_report.memory else 0
        except UsageError:
            pass
    per_1k = memory.kv_cache_bytes_per_1k_tokens or 0
    if mc.format == registry.GGUF:  # (a GGUF imported for MLX engines is held in process)
        from specgate.engines.llamacpp.build import DEFAULT_SLOT_CONTEXT, slot_context

        # llama-server allocates its whole context at start, in every
        # process, each slot capped at the trained context (build.py).
        trained = (report.gguf or {}).get("context_length")
        trained = int(trained) if trained else None
        slot, _ = slot_context(mc.max_context or min(trained or DEFAULT_SLOT_CONTEXT,
                                                     DEFAULT_SLOT_CONTEXT), trained)  # fmt: skip
        tokens = slot * mc.max_concurrent
        processes = len(mc.engines)
        per_sequence = (memory.recurrent_state_bytes or 0) + (memory.sliding_kv_bytes or 0)
        kv = per_1k * tokens // 1024 + per_sequence * mc.max_concurrent
        if mc.kv_bits is not None:
            from specgate.engines.llamacpp.build import CACHE_TYPES

            block, ratio = CACHE_TYPES[mc.kv_bits]
            kv = int(kv * ratio)
            notes.append(f"KV cache in llama.cpp's {block} blocks (kv_bits)")
        notes.append(f"{processes} llama-server process(es), each with the weights and "
                     f"{tokens} tokens of KV")  # fmt: skip
        return Footprint(memory.weights_bytes * processes, 0, kv * processes, tuple(notes))
    if mc.task in ("embed", "rerank"):
        tokens = mc.embedding.max_batch_tokens or EMBEDDING_FORWARD_TOKENS
        notes.append(f"task {mc.task}: no KV cache kept, one forward of {tokens} tokens reserved")
    elif mc.max_context:
        tokens = mc.max_context * mc.max_concurrent
    else:
        tokens = MLX_KV_RESERVE_TOKENS
        notes.append(f"KV reserved for {tokens} tokens (set max_context to reserve "
                     "max_context x max_concurrent)")  # fmt: skip
    uses_head = any(registry.record(e).needs == "mtp_head" for e in mc.engines)
    per_1k += (memory.mtp_kv_cache_bytes_per_1k_tokens or 0) if uses_head else 0
    per_sequence = (memory.recurrent_state_bytes or 0) + (memory.sliding_kv_bytes or 0)
    attention_kv = per_1k * tokens // 1024  # in the checkpoint's half precision
    kv = attention_kv + per_sequence * mc.max_concurrent
    weights = memory.weights_bytes
    half = sum(n for dtype, n in report.bytes_by_dtype.items() if dtype in _HALF_DTYPES)
    if mc.dequantize:  # every parameter in bfloat16 (inspect counts packed weights unpacked)
        weights = half = 2 * report.params
        notes.append("weights dequantized to bfloat16 (`dequantize`)")
    quantized = report.quantization is not None and not mc.dequantize
    if upcast_applies(half, quantized):
        # Its half weights, its KV and its drafter in float32, twice the bytes
        # (a GDN layer's recurrent state is float32 already).
        weights += half
        kv += per_1k * tokens // 1024 + (memory.sliding_kv_bytes or 0) * mc.max_concurrent
        drafter *= 2
        notes.append("computed in float32 on this CPU (engines/precision.py): half-precision "
                     "weights and the KV cache take twice their stored bytes")  # fmt: skip
    if mc.kv_bits is not None:
        # Its attention layers' keys and values quantized (a sliding window
        # and recurrent state are not): packed bits, and a scale and a bias
        # of the compute type per group.
        element = 4 if upcast_applies(half, quantized) else 2
        full = attention_kv * element // 2
        kv -= full - int(full * bytes_per_value(mc.kv_bits, mc.kv_group_size, element) / element)
        notes.append(f"KV cache quantized to {mc.kv_bits} bits (kv_bits)")
    return Footprint(weights, drafter, kv, tuple(notes))


def measured(engines) -> dict[str, int]:
    """After loading: bytes held by kind ("weights", "drafter", and for
    child processes "kv" and "resident"), each holder once
    (engines/base.HeldMemory); empty when nothing is measured."""
    held = {h.holder: h for engine in engines for h in engine.memory()}
    by_kind: dict[str, int] = {}
    for h in held.values():
        by_kind[h.kind] = by_kind.get(h.kind, 0) + h.nbytes
    return by_kind
