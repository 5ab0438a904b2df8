"""Building a GGUF model's llamacpp engines: what the file can do, then the processes."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specgate.engines.base import Engine
from specgate.engines.llamacpp.engine import LlamaCppEngine
from specgate.engines.llamacpp.process import LlamaServer, ServerSpec
from specgate.engines.settings import EngineSettings, LlamaServerSettings

log = logging.getLogger(__name__)

# Token texts llama.cpp treats as end-of-generation even when the GGUF's
# metadata does not name them (src/llama-vocab.cpp builds its EOG set the same
# way); specgate's stop set must match the server's.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
})
# llama-server allocates its KV cache up front; when neither the config nor a
# smaller trained context says otherwise, a slot gets this many tokens.
DEFAULT_SLOT_CONTEXT = 8192
# llama.cpp rounds each slot's context up to a multiple of this
# (llama_context's constructor pads n_ctx and n_ctx_seq with GGML_PAD 256).
CTX_PAD = 256
# llama-server keeps a little room (drafts, its context-shift guard) beyond
# what one request may fill.
SLOT_HEADROOM = 16


def slot_context(max_context: int, trained: int | None) -> tuple[int, int]:
    """(each slot's context as llama-server will size it, the tokens a request
    may hold in it). A slot never exceeds the model's trained context: past
    it the positions are ones the model never saw (llama-server only warns);
    so a config that asks for more serves a little less than trained."""
    slot = -(-(max_context + SLOT_HEADROOM) // CTX_PAD) * CTX_PAD
    if trained:
        slot = min(slot, trained // CTX_PAD * CTX_PAD or trained)
    return slot, min(max_context, slot - SLOT_HEADROOM)


@dataclass(frozen=True)
class GgufFacts:
    arch: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    context_length: int | None
    verdict: str  # `specgate inspect`'s verdict for the file
    mtp_usable: bool
    mtp_problem: str | None  # why draft-mtp cannot run, when it cannot
    embedding_length: int | None = None
    weights_bytes: int = 0  # the tensors' bytes (what the weights take, mapped once)
    kv_bytes_per_token: int = 0  # full-attention layers' f16 K and V for one token
    sliding_kv_bytes: int = 0  # per sequence: the sliding-window layers' f16 K and V
    has_chat_template: bool = True  # tokenizer.chat_template in the file


def read_gguf_facts(path: Path) -> GgufFacts:
    from specgate.engines.checkpoints.gguf_file import open_gguf
    from specgate.engines.checkpoints.gguf_info import read_gguf
    from specgate.engines.checkpoints.verdicts import judge_gguf

    info = read_gguf(path)
    judgement = judge_gguf(info)
    reader = open_gguf(info.files[0])

    def scalar(key: str):
        f = reader.get_field(key)
        return f.contents() if f is not None else None

    eos = {int(v) for k in ("eos", "eot", "eom") if (v := scalar(f"tokenizer.ggml.{k}_token_id")) is not None}
    tokens = scalar("tokenizer.ggml.tokens") or []
    eos |= {i for i, text in enumerate(tokens) if text in _EOG_TEXTS}
    problem = None
    if not judgement.mtp_usable:
        found = "; ".join(p.message for p in judgement.problems) or "it has no MTP (nextn) layers"
        problem = f"`specgate inspect` says {judgement.verdict}: {found}"
    kv = info.gguf.kv
    ctx, width = kv.get("context_length"), kv.get("embedding_length")
    from specgate.engines.checkpoints.inspect import kv_memory

    kv_per_1k, sliding = kv_memory(info, judgement)
    return GgufFacts(info.gguf.arch, int(info.vocab_size or len(tokens)), frozenset(eos),
                     int(ctx) if ctx else None, judgement.verdict, judgement.mtp_usable, problem,
                     int(width) if width else None, info.weights_bytes, kv_per_1k // 1024, sliding,
                     bool(scalar("tokenizer.chat_template")))


def check_assistant_gguf(drafter: Path, target: GgufFacts) -> None:
    """A drafter GGUF for draft-mtp's -md (Gemma-4's assistant), checked
    against the target it will read K/V from: ValueError naming what differs."""
    from specgate.engines.checkpoints.families import GGUF_ASSISTANT_ARCHS
    from specgate.engines.checkpoints.gguf_info import read_gguf

    info = read_gguf(drafter)
    arch, kv = info.gguf.arch, info.gguf.kv
    if arch not in GGUF_ASSISTANT_ARCHS:
        raise ValueError(f"drafter {drafter}: a GGUF of architecture {arch}, not a drafter "
                         f"llama-server takes with -md ({', '.join(GGUF_ASSISTANT_ARCHS)})")
    wrong = []
    if target.arch != GGUF_ASSISTANT_ARCHS[arch]:
        wrong.append(f"it drafts for {GGUF_ASSISTANT_ARCHS[arch]} targets, the model is {target.arch}")
    else:
        out = kv.get("embedding_length_out")
        if out and target.embedding_length and int(out) != target.embedding_length:
            wrong.append(f"it was released for a target of hidden size {int(out)} "
                         f"({arch}.embedding_length_out), the model's is {target.embedding_length}")
        if info.vocab_size and int(info.vocab_size) != target.vocab_size:
            wrong.append(f"its vocabulary has {int(info.vocab_size)} tokens, the model's {target.vocab_size}")
    if wrong:
        raise ValueError(f"drafter {drafter} does not fit the model: " + "; ".join(wrong))


# kv_bits -> llama.cpp's cache block type, and its bytes per value over f16's
# (q8_0: 32 values in 34 bytes; q4_0: 32 in 18).
CACHE_TYPES = {8: ("q8_0", 34 / 64), 4: ("q4_0", 18 / 64)}


def build_llamacpp_engines(
    model_id: str,
    gguf: Path,
    engines: list[str],
    *,
    settings: Mapping[str, EngineSettings],
    server: LlamaServerSettings,
    binary: str | None,
    max_context: int | None,
    max_concurrent: int,
    max_queue: int,
    drafter: Path | None = None,
    chat_template: str | None = None,
    kv_bits: int | None = None,
) -> tuple[dict[str, Engine], dict[str, str]]:
    """The model's engines by name, and the engines refused with why: one
    process per speculation mode (`llamacpp` none, `llamacpp_mtp` draft-mtp,
    `llamacpp_ngram` an n-gram type), each drafting as its `settings[name]`
    says (engines/settings.py), every process run as `server` says.

    An `llamacpp_mtp` asked for on a GGUF without a usable MTP head is
    refused (not started), and the model still serves through `llamacpp`.
    With a `drafter` (a separate drafter GGUF: Gemma-4's assistant) it
    drafts with that instead (`-md`), checked against the model first.
    The engines tokenize through each other's processes when their own hangs.
    `chat_template`: the model config's (Jinja), instead of the GGUF's.
    `kv_bits`: the KV cache in llama.cpp's q8_0 or q4_0 blocks (CACHE_TYPES).
    """
    speculation = {}
    if "llamacpp_mtp" in engines:
        speculation["llamacpp_mtp"] = {"type": "draft-mtp", "n_max": settings["llamacpp_mtp"].depth}
    if "llamacpp_ngram" in engines:
        ngram = settings["llamacpp_ngram"]
        speculation["llamacpp_ngram"] = {"type": ngram.type, "n_max": ngram.depth,
                                         "lookup": ngram.lookup_length}  # fmt: skip
    facts = read_gguf_facts(gguf)
    if facts.verdict == "incompatible":
        raise ValueError(f"{gguf}: llama.cpp cannot serve this GGUF: {facts.mtp_problem}")
    if drafter is not None:
        check_assistant_gguf(drafter, facts)
    asked = max_context or min(facts.context_length or DEFAULT_SLOT_CONTEXT, DEFAULT_SLOT_CONTEXT)
    slot, ctx = slot_context(asked, facts.context_length)
    if ctx < asked:
        log.info("model %s: %d tokens of context per request, not %d: a slot holds at most the "
                 "model's trained %d", model_id, ctx, asked, facts.context_length)
    template_file = chat_template_file(chat_template) if chat_template else None
    built: dict[str, LlamaCppEngine] = {}
    refused: dict[str, str] = {}
    for name in engines:
        if name == "llamacpp_mtp" and drafter is None and not facts.mtp_usable:
            refused[name] = _no_mtp(facts)
            log.warning("model %s: llamacpp_mtp refused: %s", model_id, refused[name])
            continue
        spec = ServerSpec(
            gguf,
            ctx_size=slot * max_concurrent,
            parallel=max_concurrent,
            spec=speculation.get(name),
            extra_args=list(server.extra_args),
            draft_model=drafter if name == "llamacpp_mtp" else None,
            chat_template_file=template_file,
            cache_type=CACHE_TYPES[kv_bits][0] if kv_bits else None,
            **({"threads": server.threads} if server.threads else {}),
        )
        process = LlamaServer(spec, binary=binary, ttl=server.idle_ttl_s,
                              health_interval=server.health_interval_s,
                              health_timeout=server.health_timeout_s,
                              health_failures=server.health_failures)  # fmt: skip
        built[name] = LlamaCppEngine(
            model_id, process, name=name, method=name if name in speculation else "none",
            max_context=ctx, vocab_size=facts.vocab_size, eos_token_ids=facts.eos_token_ids,
            max_queue=max_queue, start_at_boot=server.start == "boot",
            read_timeout=server.read_timeout_s, progress_timeout=server.progress_timeout_s,
            reproducible=server.reproducible,
            weights_bytes=facts.weights_bytes,
            kv_bytes=int((facts.kv_bytes_per_token * slot + facts.sliding_kv_bytes) * max_concurrent
                         * (CACHE_TYPES[kv_bits][1] if kv_bits else 1)),
            has_chat_template=facts.has_chat_template or template_file is not None,
        )
    if not built:
        raise ValueError(f"model {model_id}: no engine left to serve it: {'; '.join(refused.values())}")
    for engine in built.values():
        engine.tokenize_with([e.server for e in built.values()])
    return built, refused


def chat_template_file(template: str) -> Path:
    """A file holding the template, for --chat-template-file: named by its
    digest under specgate's home, so each process of each load reads the same."""
    import hashlib

    from specgate.engines.home import specgate_home

    path = specgate_home() / "chat-templates" / f"{hashlib.sha256(template.encode()).hexdigest()[:16]}.jinja"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(template, encoding="utf-8")
        tmp.replace(path)
    return path


def _no_mtp(facts: GgufFacts) -> str:
    from specgate.engines.checkpoints.families import GGUF_ASSISTANT_ARCHS

    if facts.arch in GGUF_ASSISTANT_ARCHS.values():
        return (f"{facts.arch} drafts with a separate -assistant GGUF (the MTP/ folder of its "
                "repo), which llama-server takes with -md: set the model's `drafter:` to it")
    return f"draft-mtp needs MTP layers in the GGUF; {facts.mtp_problem}"
