"""Every engine specgate can run, one record each: the one place that lists them.

A record says what the rest of specgate needs to know of an engine without
naming it: the method it serves, the checkpoint format it reads, what it
needs beyond the checkpoint, which engines it excludes, how it is built, its
depth (and its cap, and whether it is fixed when it starts), whether it times
its rounds, and how `specgate tune` times one of them. Config validation
(gateway/config.py), engine construction (gateway/serving/models.py), the policy
(policies/model_policy.py) and tuning (gateway/serving/tuning.py) iterate over
these records; adding an engine is adding a record here. An in-process
speculative method is a proposer module (engines/drafting/) and a record
whose builder is `spec_engine(name, module)`. Each record names its
settings class (engines/settings.py): the config validates the model's
`<engine>:` key against it once, and the builder gets that object.

Light to import (config validation reads it): builders import their engines,
and MLX, when they run. Nothing here imports gateway/ or policies/: a
builder reads a `BuildContext` (plain values and the engines' settings
objects), not the gateway's config.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specgate.engines.base import (
    PLAIN,
    CacheSettings,
    Engine,
    GenerationRequest,
    Method,
    Plan,
    SamplingParams,
)
from specgate.engines.settings import (
    BlockSettings,
    EmbeddingSettings,
    EngineSettings,
    LlamaCppNgramSettings,
    LlamaServerSettings,
    MTPNgramSettings,
    MTPSettings,
    NgramSettings,
    Task,
)

if TYPE_CHECKING:
    from specgate.engines.loading import LoadedModel

# The engines' names, for the few places that must pick one (the default config).
MLX_PLAIN, MLX_MTP, MLX_DFLASH, MLX_DSPARK = "mlx_plain", "mlx_mtp", "mlx_dflash", "mlx_dspark"
MLX_NGRAM, MLX_MTP_NGRAM, MLX_ASSISTANT = "mlx_ngram", "mlx_mtp_ngram", "mlx_assistant"
LLAMACPP, LLAMACPP_MTP, LLAMACPP_NGRAM = "llamacpp", "llamacpp_mtp", "llamacpp_ngram"

# Tokens of context when neither the config nor the checkpoint names a length.
FALLBACK_MAX_CONTEXT = 4096


@dataclass(frozen=True)
class Format:
    """A checkpoint format engines serve."""

    name: str
    description: str  # as a config error says it: "a GGUF file"
    in_process: bool  # its engines load it into this process (`specgate tune` measures those)


MLX = Format("mlx", "an MLX/Hugging Face checkpoint", in_process=True)
GGUF = Format("gguf", "a GGUF file", in_process=False)

# What an engine needs beyond the checkpoint: nothing, the checkpoint's own
# MTP head (a checkpoint without one fails to load, saying why), or a
# drafter directory (the model's `drafter`, of the record's drafter_kind).
Needs = Literal["nothing", "mtp_head", "drafter"]


@dataclass
class BuildContext:
    """What a builder reads of its model's config: the model's own values,
    each engine's settings object as the config validated it (engines/
    settings.py), and the model once loaded (MLX: loaded on first use,
    shared by its engines)."""

    model_id: str
    path: str  # the checkpoint: a directory, a hub repo id or a .gguf file (builtins resolved)
    format: Format
    engines: tuple[str, ...] = ()  # the configured engines, in the config's order
    max_context: int | None = None  # None: the checkpoint's, else FALLBACK_MAX_CONTEXT
    max_concurrent: int = 8
    max_queue: int = 64
    prefix_cache_size: int = 64
    prefix_cache: CacheSettings = field(default_factory=CacheSettings)
    kernels: str = "auto"  # "auto" | "off" (kernels/wiring.py)
    dequantize: bool = False  # quantized layers loaded as bfloat16 (engines/mlx_load.py)
    kv_bits: int | None = None  # the KV cache quantized (engines/forwards/quantized_kv.py)
    kv_group_size: int = 64
    # Engine name -> its settings (its record's `settings` class); an engine
    # not named gets its record's defaults (settings_of).
    settings: Mapping[str, EngineSettings] = field(default_factory=dict)
    drafter: str | None = None  # a local directory (builtins resolved)
    llama_server: LlamaServerSettings = field(default_factory=LlamaServerSettings)
    llama_server_binary: str | None = None  # None: PATH, then `specgate install-llama-server`'s
    chat_template: str | None = None  # the config's template text, instead of the checkpoint's
    task: Task | None = None  # generate | embed | rerank; None: from the checkpoint (worker.py)
    embedding: EmbeddingSettings = field(default_factory=EmbeddingSettings)
    distribution: Any = None  # engines/distributed/lockstep.Distribution: this rank's shard of the model
    loaded: LoadedModel | None = None

    def mlx_model(self) -> LoadedModel:
        if self.loaded is None:
            from specgate.engines.loading import load_mlx_model

            self.loaded = load_mlx_model(self.path, self.prefix_cache, self.distribution,
                                         self.chat_template, self.dequantize, self.kv_bits,
                                         self.kv_group_size)  # fmt: skip
        return self.loaded

    def settings_of(self, name: str) -> EngineSettings:
        """The engine's own settings: as configured, else its record's defaults."""
        given = self.settings.get(name)
        return given if given is not None else record(name).settings()

    def context_length(self) -> int:
        """An in-process engine's context: the config's, else the checkpoint's."""
        return self.max_context or self.mlx_model().max_position_embeddings or FALLBACK_MAX_CONTEXT


# The engines a builder made by name, and those it refused with why.
Built = tuple[dict[str, Engine], dict[str, str]]
# builder(context, names): the records naming one builder are built by one call.
Builder = Callable[[BuildContext, tuple[str, ...]], Built]
# timer(engine, prompt) -> round_at: round_at(depth) prepares a fresh
# sequence and returns the call that runs one round of it at that depth.
RoundTimer = Callable[[Engine, list[int]], Callable[[int], Callable[[], object]]]


@dataclass(frozen=True)
class EngineRecord:
    name: str
    method: Method
    format: Format
    build: Builder
    # Its own per-model settings (engines/settings.py): the model's `<name>:`
    # key in YAML, validated once, handed to the builder as it is.
    settings: type[EngineSettings] = EngineSettings
    needs: Needs = "nothing"
    drafter_kind: str | None = None  # needs == "drafter": what the directory holds
    # Takes the model's `drafter` where one is given, drafting without it
    # otherwise (llamacpp_mtp: a Gemma-4 -assistant GGUF, llama-server -md).
    accepts_drafter: bool = False
    # One engine per model of each group: the `drafter` key holds one drafter.
    exclusive: str | None = None
    default: bool = False  # listed when a model's config lists no engines
    always: bool = False  # built for every model of its format, listed or not (built first)
    # The depth it plans by default, from its settings and the engine built.
    depth: Callable[[EngineSettings, Engine], int] | None = None
    depth_cap: Callable[[Engine], int] | None = None  # the most it drafts a round (else: depth)
    fixed_depth: bool = False  # its depth is set when it starts, not per request
    times_rounds: bool = True  # its RoundStats carry seconds (llama-server reports sums)
    tune: RoundTimer | None = None  # how `specgate tune` times one of its rounds
    # The method a request may also name it by (X-Specgate-Method: ngram on a
    # GGUF model means its llamacpp_ngram), so clients need not know the backend.
    answers_to: Method | None = None
    # Runs over several ranks of a distributed model (engines/distributed/lockstep.py):
    # every decision it takes outside the model's numbers is shared.
    distributed: bool = False

    @property
    def speculative(self) -> bool:
        return self.method != PLAIN


# -- builders (they import their engines, and MLX, when they run) ----------------------


def _single(make: Callable[[BuildContext], Engine]) -> Builder:
    def build(ctx: BuildContext, names: tuple[str, ...]) -> Built:
        return {name: make(ctx) for name in names}, {}

    return build


def _plain(ctx: BuildContext) -> Engine:
    from specgate.engines.mlx_plain import MLXPlainEngine

    return MLXPlainEngine(ctx.model_id, ctx.mlx_model(), max_context=ctx.context_length(),
                          max_concurrent=ctx.max_concurrent, max_queue=ctx.max_queue,
                          prefix_cache_size=ctx.prefix_cache_size, task=ctx.task,
                          embedding=ctx.embedding, kernels=ctx.kernels)  # fmt: skip


def spec_engine(name: str, proposers: str) -> Builder:
    """An in-process speculative engine (engines/mlx_spec/engine.py) drafting
    with the module `proposers` (e.g. "specgate.engines.drafting.mtp.proposer"),
    whose `drafting(loaded, target, drafter, settings)` loads what it needs,
    given the engine's settings as the config validated them; imported when
    the engine is built.
    Asked for by name: a checkpoint (or drafter) that cannot draft fails to
    load with the reason, rather than quietly serving plain decoding."""

    def make(ctx: BuildContext) -> Engine:
        from specgate.engines.mlx_spec.engine import SpecEngine

        module = importlib.import_module(proposers)
        return SpecEngine(ctx.model_id, ctx.mlx_model(), name=name, drafting=module.drafting,
                          settings=ctx.settings_of(name), drafter=ctx.drafter,
                          max_context=ctx.context_length(), max_queue=ctx.max_queue,
                          kernels=ctx.kernels)  # fmt: skip

    return _single(make)


def _llamacpp(ctx: BuildContext, names: tuple[str, ...]) -> Built:
    """The llama-server engines of a GGUF from one read of it (they
    tokenize through each other's processes)."""
    from specgate.engines.llamacpp.build import build_llamacpp_engines

    return build_llamacpp_engines(
        ctx.model_id, Path(ctx.path), list(names),
        settings={name: ctx.settings_of(name) for name in names}, server=ctx.llama_server,
        binary=ctx.llama_server_binary, max_context=ctx.max_context,
        max_concurrent=ctx.max_concurrent, max_queue=ctx.max_queue,
        drafter=Path(ctx.drafter) if ctx.drafter else None, chat_template=ctx.chat_template,
        kv_bits=ctx.kv_bits,
    )


def spec_rounds(engine, prompt: list[int]) -> Callable[[int], Callable[[], object]]:
    """An in-process speculative engine's rounds as tune times them: the
    engine's own decoder (the engine built, not started) on a fresh
    sequence per depth, prefilled, so every depth runs at the same context."""

    def round_at(depth: int) -> Callable[[], object]:
        request = GenerationRequest("tune", "tune", prompt, SamplingParams(), 1 << 20,
                                    Plan(engine.name, engine.method, depth, "spec_on"))  # fmt: skip
        decoder = engine.make_decoder(request, None, 0)
        decoder.prefill()
        return lambda: decoder.round(depth)

    return round_at


def _depth(settings: EngineSettings, engine) -> int:
    return settings.depth  # llamacpp_mtp: its --spec-draft-n-max; llamacpp_ngram: its draft size


def _block_depth(settings: EngineSettings, engine) -> int:
    return min(settings.depth or engine.max_drafts, engine.max_drafts)


def _max_drafts(engine) -> int:
    return engine.max_drafts


_RECORDS: dict[str, EngineRecord] = {}
_DRAFTING = "specgate.engines.drafting"


def register(record: EngineRecord) -> EngineRecord:
    if record.name in _RECORDS:
        raise ValueError(f"engine {record.name} is registered already")
    if (record.needs == "drafter") != (record.drafter_kind is not None):
        raise ValueError(f"engine {record.name}: a drafter_kind goes with needs='drafter'")
    _RECORDS[record.name] = record
    return record


def unregister(name: str) -> None:
    del _RECORDS[name]


@contextmanager
def registered(*records: EngineRecord) -> Iterator[None]:
    """The records added for a while (tests)."""
    for r in records:
        register(r)
    try:
        yield
    finally:
        for r in records:
            _RECORDS.pop(r.name, None)


for _record in (
    EngineRecord(MLX_PLAIN, PLAIN, MLX, _single(_plain), default=True, always=True,
                 distributed=True),
    EngineRecord(MLX_MTP, "mtp", MLX, spec_engine(MLX_MTP, f"{_DRAFTING}.mtp.proposer"),
                 settings=MTPSettings, needs="mtp_head", depth=_depth, tune=spec_rounds,
                 distributed=True),
    EngineRecord(MLX_DFLASH, "dflash", MLX, spec_engine(MLX_DFLASH, f"{_DRAFTING}.dflash.proposer"),
                 settings=BlockSettings, needs="drafter", drafter_kind="dflash",
                 exclusive="drafter", depth=_block_depth, depth_cap=_max_drafts, tune=spec_rounds),
    EngineRecord(MLX_DSPARK, "dspark", MLX, spec_engine(MLX_DSPARK, f"{_DRAFTING}.dspark.proposer"),
                 settings=BlockSettings, needs="drafter", drafter_kind="dspark",
                 exclusive="drafter", depth=_block_depth, depth_cap=_max_drafts, tune=spec_rounds),
    # A drafter that reads the target's own K/V (Gemma-4's -assistant
    # checkpoints): drafts one token a step, like an MTP head.
    EngineRecord(MLX_ASSISTANT, "gemma4_assistant", MLX,
                 spec_engine(MLX_ASSISTANT, f"{_DRAFTING}.assistant.proposer"),
                 settings=MTPSettings, needs="drafter", drafter_kind="gemma4_assistant",
                 exclusive="drafter", depth=_depth, tune=spec_rounds),
    # Copies from the context: any model. No tune timer (a fresh prompt has
    # nothing to copy): its prior is the verify cost, learned live from there.
    EngineRecord(MLX_NGRAM, "ngram", MLX, spec_engine(MLX_NGRAM, f"{_DRAFTING}.ngram.proposer"),
                 settings=NgramSettings, depth=_depth),
    EngineRecord(MLX_MTP_NGRAM, "mtp+ngram", MLX,
                 spec_engine(MLX_MTP_NGRAM, f"{_DRAFTING}.mtp_ngram"),
                 settings=MTPNgramSettings, needs="mtp_head", depth=_depth),
    # One builder: every process comes from one read of the GGUF.
    EngineRecord(LLAMACPP, PLAIN, GGUF, _llamacpp, default=True, times_rounds=False),
    EngineRecord(LLAMACPP_MTP, "llamacpp_mtp", GGUF, _llamacpp, settings=MTPSettings,
                 needs="mtp_head", accepts_drafter=True, depth=_depth, fixed_depth=True,
                 times_rounds=False, answers_to="mtp"),
    EngineRecord(LLAMACPP_NGRAM, "llamacpp_ngram", GGUF, _llamacpp,
                 settings=LlamaCppNgramSettings, depth=_depth, fixed_depth=True,
                 times_rounds=False, answers_to="ngram"),
):  # fmt: skip
    register(_record)


# -- looking records up ------------------------------------------------------------------


def records(fmt: Format | None = None) -> tuple[EngineRecord, ...]:
    """The records (of one format), in the registry's order."""
    return tuple(r for r in _RECORDS.values() if fmt is None or r.format == fmt)


def record(name: str) -> EngineRecord:
    try:
        return _RECORDS[name]
    except KeyError:
        raise KeyError(f"no engine {name!r}; engines: {', '.join(_RECORDS)}") from None


def names(fmt: Format | None = None) -> tuple[str, ...]:
    return tuple(r.name for r in records(fmt))


def methods() -> tuple[Method, ...]:
    """Every method some engine serves, once each, in the registry's order."""
    return tuple(dict.fromkeys(r.method for r in _RECORDS.values()))


def method_of(name: str) -> Method:
    return record(name).method


def resolve_method(asked: Method, available: Iterable[Method]) -> Method:
    """The available method a request asking for `asked` gets: `asked`
    itself, else one whose engine answers to it (see answers_to)."""
    available = list(available)
    if asked in available:
        return asked
    return next((r.method for r in _RECORDS.values()
                 if r.answers_to == asked and r.method in available), asked)  # fmt: skip


def proving(engine) -> bool:
    """The engine's verify kernels are being proved in the background
    (engines/mlx_spec/kernel_proofs.py): its rounds verify on the stock
    path until they are, which on a GPU loses to plain decoding."""
    return bool(getattr(engine, "kernels_proving", False))


def batches(engine) -> bool:
    """The engine verifies several requests' drafts in one batch
    (engines/mlx_spec/engine.py's `batches_speculation`): a batched round's
    cost applies to it. Others run concurrent requests one after another."""
    return bool(getattr(engine, "batches_speculation", lambda: False)())


def max_batch(engine) -> int | None:
    """The most requests a batching engine speculates for in one batch (the
    others wait their turn there), or None (no limit known)."""
    return getattr(engine, "max_batch", None) if batches(engine) else None


def excludes(name: str) -> tuple[str, ...]:
    """The engines a model cannot list beside this one."""
    group = record(name).exclusive
    return tuple(r.name for r in _RECORDS.values()
                 if group is not None and r.exclusive == group and r.name != name)  # fmt: skip


def build_engines(ctx: BuildContext) -> Built:
    """Blocking: the model's engines (its format's always-built ones first,
    then the configured ones, in the registry's order; a builder shared by
    several records gets their names in the config's order, at once), and
    the configured engines refused, with why."""
    wanted = [r for r in records(ctx.format) if r.always or r.name in ctx.engines]
    order = {name: i for i, name in enumerate(ctx.engines)}
    built: dict[str, Engine] = {}
    refused: dict[str, str] = {}
    done: list[Builder] = []
    for rec in wanted:
        if rec.build in done:
            continue
        done.append(rec.build)
        together = sorted((r.name for r in wanted if r.build is rec.build),
                          key=lambda n: order.get(n, -1))  # fmt: skip
        engines, why = rec.build(ctx, tuple(together))
        built.update(engines)
        refused.update(why)
    return built, refused
