"""`specgate inspect`: what a checkpoint can do, before anything loads.

    report = inspect_checkpoint("path/or/org-name", target=None)
    print(render_text(report))          # or json.dumps(report.to_dict())

It takes what `specgate serve` takes: a builtin name (builtin:demo,
builtin:demo-gguf, builtin:demo-dflash), a local path, a model store's name
(ollama:, lmstudio:, sources.py), or a Hugging Face repo id, looked up only
in the local hub cache: inspect never downloads.
Builtin names are resolved by the caller's `builtin` (the CLI passes
specgate.engines.checkpoints.builtin.builtin_path): this package only reads.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from .info import CheckpointError, CheckpointInfo
from .locate import BUILTIN_PREFIX, REPO_ID, cached_snapshot, looks_local, not_downloaded
from .reader import read_checkpoint
from .sources import SourceError, resolve_source
from .verdicts import EngineFit, Judgement, Problem, judge_drafter, judge_gguf, judge_target

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
OK_VERDICTS = ("verified", "family-compatible", "ar-only")

_ACT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


class UsageError(Exception):
    """Not a checkpoint we can look at: missing path, repo not downloaded, bad flags."""


@dataclass
class Memory:
    weights_bytes: int
    mtp_head_bytes: int
    kv_cache_bytes_per_1k_tokens: int | None
    mtp_kv_cache_bytes_per_1k_tokens: int | None
    recurrent_state_bytes: int | None  # per sequence, constant in length
    # Per sequence: the sliding-window layers' KV, bounded by the window, not the context.
    sliding_kv_bytes: int | None = None
    assumptions: list[str] = field(default_factory=list)


@dataclass
class Report:
    source: str  # what the user typed
    path: str  # the local path read
    format: str  # "safetensors" | "gguf" | "unreadable"
    kind: str  # "target" | "drafter"
    verdict: str
    family: str | None
    model_type: str | None
    text_model_type: str | None
    architectures: list[str]
    layout: str
    hidden_size: int | None
    vocab_size: int | None
    num_hidden_layers: int | None
    layer_types: dict[str, int]
    params: int
    params_by_dtype: dict[str, int]
    bytes_by_dtype: dict[str, int]
    quantization: dict | None
    mtp: dict
    drafter: dict | None
    norms: dict | None
    gguf: dict | None
    memory: Memory | None
    engines: list[EngineFit]
    problems: list[Problem]
    notes: list[str]
    target: dict | None = None  # the --target's own summary

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.verdict in OK_VERDICTS else EXIT_PROBLEM

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- locating


# A builtin name's path (specgate.engines.checkpoints.builtin.builtin_path); it
# raises ValueError for a name that is none, FileNotFoundError for an
# incomplete install.
BuiltinResolver = Callable[[str], Path]


def resolve_local(source: str, builtin: BuiltinResolver | None = None) -> Path:
    """A builtin's path (through `builtin`), a local path, or the snapshot of
    a hub repo already in the local cache."""
    if source.startswith(BUILTIN_PREFIX):
        if builtin is None:
            raise UsageError(f"{source}: a builtin name, and no builtin models here")
        try:
            return builtin(source)
        except (ValueError, FileNotFoundError) as e:  # unknown name, incomplete install
            raise UsageError(str(e)) from None
    path = Path(source).expanduser()
    if path.exists():
        return path
    try:
        stored = resolve_source(source)  # ollama:, lmstudio:, a GGUF repo in the hub cache
    except SourceError as e:
        raise UsageError(str(e)) from None
    if stored is not None:
        return stored
    if looks_local(source) or not REPO_ID.match(source):
        raise UsageError(f"{source}: no such file or directory")
    snapshot = cached_snapshot(source)
    if snapshot is None:
        raise UsageError(not_downloaded(source, "specgate inspect never downloads. "))
    return snapshot


# ---------------------------------------------------------------- memory


def _gdn_state(tc: dict, gguf_kv: dict | None, act: int) -> int | None:
    """Bytes of one GatedDeltaNet layer's state: conv window + recurrent matrix."""
    if "linear_num_value_heads" in tc:
        hv, hk = tc["linear_num_value_heads"], tc["linear_num_key_heads"]
        dv, dk = tc["linear_value_head_dim"], tc["linear_key_head_dim"]
        kernel = tc.get("linear_conv_kernel_dim", 4)
    elif gguf_kv and "ssm.time_step_rank" in gguf_kv:
        # llama.cpp's qwen3next/qwen35 keys: dt_rank = value heads, group_count =
        # key heads, state_size = key head dim, inner_size = all value dims.
        hv, hk = gguf_kv["ssm.time_step_rank"], gguf_kv["ssm.group_count"]
        dk, dv = gguf_kv["ssm.state_size"], gguf_kv["ssm.inner_size"] // hv
        kernel = gguf_kv.get("ssm.conv_kernel", 4)
    else:
        return None
    conv = (kernel - 1) * (2 * hk * dk + hv * dv) * act
    return conv + hv * dv * dk * 4  # the recurrent state is kept in float32


def _memory(info: CheckpointInfo, j: Judgement) -> Memory:
    mem = Memory(info.weights_bytes, info.mtp.nbytes, None, None, None)
    if info.format == "gguf":
        act = 2
        mem.assumptions.append("llama.cpp's default f16 KV cache")
    else:
        act = _ACT_BYTES.get(str(info.dtype).replace("torch.", ""), 2)
        mem.assumptions.append(f"activations {act} bytes ({info.dtype or 'no dtype in config'})")
    tc = info.text_config
    if info.drafter and info.drafter.kind == "gemma4_assistant":
        # It attends to the target's K/V and keeps no cache of its own.
        mem.kv_cache_bytes_per_1k_tokens = 0
        return mem
    if "kv_lora_rank" in tc:  # MLA: mlx-lm caches the latent and the rope key
        per_layer = tc["kv_lora_rank"] + tc.get("qk_rope_head_dim", 0)
        mem.assumptions.append("MLA: latent + rope key cached per layer (mlx-lm deepseek_v3)")
    elif info.num_key_value_heads and info.head_dim:
        per_layer = 2 * info.num_key_value_heads * info.head_dim
    else:
        mem.assumptions.append("KV cache unknown: no kv heads / head_dim")
        return mem
    full = info.layer_types.get("full_attention", 0)
    mem.kv_cache_bytes_per_1k_tokens = full * per_layer * act * 1024
    if swa := info.layer_types.get("sliding_attention"):
        window = info.sliding_window or tc.get("sliding_window")
        if window:
            kv = info.gguf.kv if info.gguf else {}
            swa_dim = kv.get("attention.key_length_swa") or info.head_dim
            mem.sliding_kv_bytes = swa * 2 * info.num_key_value_heads * swa_dim * act * int(window)
            mem.assumptions.append(f"{swa} sliding-window layers hold {window} tokens each")
        else:
            mem.assumptions.append(f"{swa} sliding-window layers not counted (no sliding_window)")
    if j.mtp_usable and info.mtp.present:
        mem.mtp_kv_cache_bytes_per_1k_tokens = info.mtp.present * per_layer * act * 1024
    gdn = info.layer_types.get("linear_attention", 0)
    if gdn:
        per_gdn = _gdn_state(tc, info.gguf.kv if info.gguf else None, act)
        if per_gdn is None:
            mem.assumptions.append(f"{gdn} recurrent layers: state size not in this file")
        else:
            mem.recurrent_state_bytes = gdn * per_gdn
            mem.assumptions.append("GDN: conv window in activation dtype, recurrent state float32")
    return mem


def kv_memory(info: CheckpointInfo, j: Judgement) -> tuple[int, int]:
    """(KV bytes per 1k tokens of context, KV bytes per sequence its
    sliding-window layers hold): 0 where not known."""
    mem = _memory(info, j)
    return mem.kv_cache_bytes_per_1k_tokens or 0, mem.sliding_kv_bytes or 0


# ---------------------------------------------------------------- the report


def _summary(info: CheckpointInfo, j: Judgement, source: str) -> Report:
    q = info.quantization
    return Report(
        source=source, path=info.path, format=info.format,
        kind="drafter" if info.drafter else "target", verdict=j.verdict, family=j.family,
        model_type=info.model_type, text_model_type=info.text_model_type,
        architectures=info.architectures, layout=info.layout, hidden_size=info.hidden_size,
        vocab_size=info.vocab_size, num_hidden_layers=info.num_hidden_layers,
        layer_types=info.layer_types, params=info.params, params_by_dtype=info.params_by_dtype,
        bytes_by_dtype=info.bytes_by_dtype, quantization=asdict(q) if q else None,
        mtp={k: v for k, v in asdict(info.mtp).items() if k != "tensor_names"}
        | {"tensors": len(info.mtp.tensor_names)},
        drafter=asdict(info.drafter) if info.drafter else None,
        norms=asdict(info.norms) if info.norms else None,
        gguf=({k: v for k, v in asdict(info.gguf).items() if k != "kv"}
              | {"context_length": info.gguf.kv.get("context_length")} if info.gguf else None),
        memory=_memory(info, j), engines=j.engines, problems=j.problems, notes=j.notes,
    )


def _unreadable(source: str, path: Path, err: CheckpointError, kind: str = "target") -> Report:
    problem = Problem("unreadable", f"cannot read the checkpoint: {err}",
                      "re-download or re-convert it", "incompatible")
    return Report(source, str(path), "unreadable", kind, "incompatible", None, None, None, [],
                  "unknown", None, None, None, {}, 0, {}, {}, None, {}, None, None, None, None,
                  [], [problem], [])


def _judge(info: CheckpointInfo) -> Judgement:
    if info.format != "gguf":
        return judge_target(info)
    j = judge_gguf(info)
    from .gguf_import import importable_info  # the MLX engines serve it imported

    if j.verdict != "incompatible" and importable_info(info) is None:
        j.engines += [EngineFit(e, [m], "(imported to MLX)") for e, m in (("mlx_plain", "none"),
                                                                          ("mlx_ngram", "ngram"))]
    return j


def inspect_checkpoint(path_or_repo: str, *, target: str | None = None,
                       builtin: BuiltinResolver | None = None) -> Report:
    """Read `path_or_repo` (and `target`, for a drafter) and judge it;
    `builtin` resolves builtin names (see resolve_local).

    Raises UsageError for what is not there or a --target on a non-drafter;
    everything wrong with a checkpoint that is there comes back as problems.
    """
    path = resolve_local(path_or_repo, builtin)
    target_path = resolve_local(target, builtin) if target else None
    try:
        info = read_checkpoint(path)
    except CheckpointError as e:
        return _unreadable(path_or_repo, path, e)
    if info.drafter is None:
        if target_path is not None:
            raise UsageError(f"--target pairs a drafter with its target; {path_or_repo} is not a "
                             f"drafter (model_type {info.model_type})")
        return _summary(info, _judge(info), path_or_repo)

    target_info = target_j = target_err = None
    if target_path is not None:
        try:
            target_info = read_checkpoint(target_path)
            target_j = _judge(target_info) if target_info.drafter is None else None
        except CheckpointError as e:
            target_err = e
    j = judge_drafter(info, target_info, target_j)
    if target_err is not None:
        j.problem("target_unreadable", f"cannot read the target: {target_err}",
                  "give a readable target checkpoint", "incompatible")
    report = _summary(info, j, path_or_repo)
    if target_info is not None:
        report.target = {"path": target_info.path, "model_type": target_info.model_type,
                         "hidden_size": target_info.hidden_size, "vocab_size": target_info.vocab_size,
                         "num_hidden_layers": target_info.num_hidden_layers,
                         "verdict": target_j.verdict if target_j else None}
    return report


# ---------------------------------------------------------------- text


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def render_text(r: Report) -> str:
    rows: list[tuple[str, str]] = [("verdict", r.verdict)]
    model = r.model_type or "unknown"
    if r.text_model_type:
        model += f" (text: {r.text_model_type})"
    if r.family:
        model += f": {r.family}"
    rows.append(("model", model))
    if r.format != "unreadable":
        layout = {"hf": "raw Hugging Face layout", "mlx": "mlx-converted layout"}.get(r.layout)
        if r.gguf:
            layout = f"file type {r.gguf['file_type']}"
        rows.append(("format", f"{r.format}, {layout}"))
        kinds = ", ".join(f"{n} {t}" for t, n in r.layer_types.items())
        n = r.num_hidden_layers
        rows.append(("shape", f"{n} layer{'' if n == 1 else 's'} ({kinds}), hidden {r.hidden_size}, "
                              f"vocab {r.vocab_size}"))
        dtypes = ", ".join(f"{d} {_size(b)}" for d, b in r.bytes_by_dtype.items())
        rows.append(("parameters", f"{_count(r.params)} ({dtypes})"))
        rows.append(("quantization", r.quantization["description"] if r.quantization else "none"))
    if r.kind == "target" and r.format != "unreadable":
        m = r.mtp
        declared = f"declared {m['declared']}" + (f" ({m['declared_key']})" if m["declared_key"] else "")
        present = f"present {m['present']}"
        if m["present"]:
            present += f" ({m['prefix']}*, {m['tensors']} tensors, {_size(m['nbytes'])})"
        rows.append(("MTP", f"{declared}, {present}"))
    if r.drafter:
        d = r.drafter
        needs = [f"hidden {d['target_hidden_size']}", f"vocab {d['vocab_size']}"]
        if d["num_target_layers"]:
            needs.append(f"{d['num_target_layers']} layers")
        if d["target_layer_ids"]:
            needs.append(f"layers {d['target_layer_ids']}")
        block = f", block {d['block_size']}" if d["block_size"] else ""
        rows.append(("drafter", f"{d['kind']}{block}; target needs " + ", ".join(needs)))
    if r.target:
        t = r.target
        rows.append(("target", f"{t['path']} ({t['model_type']}, hidden {t['hidden_size']}, "
                               f"vocab {t['vocab_size']}, {t['num_hidden_layers']} layers; "
                               f"on its own: {t['verdict']})"))
    if r.memory:
        m = r.memory
        mem = f"weights {_size(m.weights_bytes)}"
        if m.mtp_head_bytes:
            mem += f" (MTP head {_size(m.mtp_head_bytes)})"
        mem += f"; KV cache {_size(m.kv_cache_bytes_per_1k_tokens)} per 1k tokens"
        if m.sliding_kv_bytes:
            mem += f" + {_size(m.sliding_kv_bytes)} per sequence (sliding window)"
        if m.mtp_kv_cache_bytes_per_1k_tokens:
            mem += f" (+{_size(m.mtp_kv_cache_bytes_per_1k_tokens)} MTP)"
        if m.recurrent_state_bytes:
            mem += f"; recurrent state {_size(m.recurrent_state_bytes)} per sequence"
        rows.append(("memory", mem))
    engines = "; ".join(f"{e.engine} ({', '.join(e.methods)})" + (f" {e.note}" if e.note else "")
                        for e in r.engines)
    rows.append(("engines", engines or "none"))
    lines = [f"specgate inspect {r.source}"]
    lines += [f"  {k:<13}{v}" for k, v in rows]
    lines.append("  problems" + ("" if r.problems else "     none"))
    for p in r.problems:
        lines.append(f"    [{p.code}] {p.message}")
        lines.append(f"      action: {p.action}")
    for n in r.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def run_cli(source: str, target: str | None, as_json: bool, out: TextIO = sys.stdout,
            err: TextIO = sys.stderr, *, builtin: BuiltinResolver | None = None) -> int:
    """`specgate inspect`: 0 usable, 1 incompatible / no MTP heads, 2 usage error."""
    try:
        report = inspect_checkpoint(source, target=target, builtin=builtin)
    except UsageError as e:
        print(f"specgate inspect: {e}", file=err)
        return EXIT_USAGE
    print(json.dumps(report.to_dict(), indent=2) if as_json else render_text(report), file=out)
    return report.exit_code
