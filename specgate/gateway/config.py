"""specgate's YAML config, validated with pydantic.

A bad config fails at start with the file, the key path and what was
expected, never with a traceback from deep inside the server. Reading it
is bounded whatever the file holds: its size, UTF-8 text only, and the
nodes its YAML aliases expand to (a few hundred bytes of nested aliases, a
"billion laughs", expand to billions), so a reload runs it off the event
loop as a job of bounded size.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specgate.engines import registry
from specgate.engines.checkpoints.builtin import (
    BUILTIN_DEMO,
    BUILTIN_DEMO_DFLASH,
    BUILTIN_DEMO_GGUF,
    BUILTIN_PREFIX,
    DEFAULT_MODEL_ID,
)
from specgate.engines.settings import EmbeddingSettings, EngineSettings, LlamaServerSettings, Task
from specgate.policies.config import PolicyConfig


def _known_engine(name: str) -> str:
    """An engine engines/registry.py lists (read at validation, not import)."""
    if name not in registry.names():
        raise PydanticCustomError("unknown_engine", "no such engine; engines: {known}",
                                  {"known": ", ".join(registry.names())})
    return name


EngineName = Annotated[str, AfterValidator(_known_engine)]


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# "64GiB", "512 MiB", "2G", "1024B": binary units whatever the spelling.
_SIZE = r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])i?b?|b)\s*"
_SIZE_JSON = r"^\s*\d+(\.\d+)?\s*([kKmMgGtT][iI]?[bB]?|[bB])\s*$"  # no (?i) in editors' regex
_SHARE = r"\s*(\d+(?:\.\d+)?)\s*%\s*"  # of physical memory


def _size_parser(*, share: bool, zero: bool):
    """A string with a unit to bytes; with `share`, also a percentage of
    physical memory. A bare number is refused (`memory_budget: 96` was 96
    bytes, never what was meant), but with `zero` a bare 0, which means none."""
    import re

    from specgate.engines.memory import physical_memory

    wanted = ("a size needs a unit, like 64GiB or 512MiB"
              + (", or a share of RAM like 75%" if share else "") + (", or 0 for none" if zero else ""))  # fmt: skip

    def parse(v):
        if isinstance(v, str):
            if m := re.fullmatch(_SIZE, v, re.IGNORECASE):
                return int(float(m[1]) * _UNITS[(m[2] or "").lower()])
            if share and (m := re.fullmatch(_SHARE, v)):
                if not 0 < float(m[1]) <= 100:
                    raise PydanticCustomError("ram_share", "a share of RAM is more than 0% and at most 100%")
                return int(physical_memory() * float(m[1]) / 100)
        elif zero and type(v) is int and v == 0:
            return 0
        raise PydanticCustomError("byte_size", wanted)

    return parse


def _size_type(*, share: bool = False, zero: bool = False):
    forms = [{"type": "string", "pattern": _SIZE_JSON}]
    if share:
        forms.append({"type": "string", "pattern": f"^{_SHARE}$"})
    if zero:
        forms.append({"const": 0})
    return Annotated[int, BeforeValidator(_size_parser(share=share, zero=zero)),
                     WithJsonSchema({"anyOf": forms})]  # fmt: skip


ByteSize = _size_type()  # "512MiB"
ByteSizeOrZero = _size_type(zero=True)  # also a bare 0, where 0 means none
RamSize = _size_type(share=True)  # also "75%", of physical memory


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponsesStoreConfig(_Strict):
    """Responses kept for the Responses API's `previous_response_id`
    (gateway/api/responses_api.py), in memory, each API key's apart: a key
    over either quota forgets its own least recently used, never another
    key's."""

    responses_per_key: int = Field(1024, ge=0)
    bytes_per_key: ByteSizeOrZero = Field("32MiB", validate_default=True)  # of stored items, as JSON; 0: none kept


class ImageUrlConfig(_Strict):
    """Images named by an http(s) URL in a request (gateway/serving/images.py).
    Off by default: a server on the LAN that fetches what a client names can
    be made to reach hosts the client cannot. Data URLs and base64 images
    need none of this (the body limit bounds them)."""

    fetch: bool = False
    max_bytes: ByteSize = Field("16MiB", gt=0, validate_default=True)  # larger images get a 400
    timeout_s: float = Field(10.0, gt=0)  # the whole fetch, redirects included


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: ByteSize = Field("4MiB", gt=0, validate_default=True)  # larger bodies get 413
    body_timeout_s: float = Field(30.0, gt=0)  # longest wait for the next piece of a body
    body_deadline_s: float = Field(60.0, gt=0)  # a whole body arrives within this; else 408
    # SIGTERM: running requests may finish for this long, then end with an
    # error; the engines stop together within the same period.
    shutdown_grace_s: float = Field(10.0, ge=0)
    # A model whose load failed is tried again after load_retry_min_s, twice
    # as long after each further failure, at most load_retry_max_s apart: a
    # `load: boot` model by itself, one loaded on demand by the first request
    # after that (until then requests get the error at once).
    load_retry_min_s: float = Field(5.0, gt=0)
    load_retry_max_s: float = Field(300.0, gt=0)
    max_header_bytes: ByteSize = Field("64KiB", gt=0, validate_default=True)  # all request headers together; else 431
    # A connection's request line and headers arrive within this of its
    # opening (or of the previous response's end), or it is closed.
    header_timeout_s: float = Field(10.0, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)  # an idle connection between requests closes
    # A stream whose first token takes longer than this (a long prefill, a
    # wait for a slot) starts at once and sends a keep-alive this often
    # until it comes (an SSE comment; Anthropic's `ping`). Before it, an
    # error still gets its own status code.
    stream_keepalive_s: float = Field(2.5, gt=0)
    # Connections one client address (IPv6: its /64) may hold at once; those
    # past it are closed before anything is read. 0: no cap.
    max_connections_per_client: int = Field(256, ge=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # json: every log line a JSON object, for log shippers (gateway/access/access_log.py).
    log_format: Literal["text", "json"] = "text"
    # Memory for every loaded model together (weights, drafters, their KV
    # reserve) and the prefix cache's RAM, which comes off it first (see
    # Config.budgets). A model that does not fit evicts the least recently
    # used idle ones; one that could never fit is refused. "96GiB" or a
    # share of physical memory, "75%"; default: 75%.
    memory_budget: RamSize | None = None
    responses_store: ResponsesStoreConfig = Field(default_factory=ResponsesStoreConfig)
    image_urls: ImageUrlConfig = Field(default_factory=ImageUrlConfig)


class AuthConfig(_Strict):
    """API keys (gateway/access/auth.py). With no keys the server is open, and only
    a loopback bind is allowed."""

    keys_file: str | None = None  # default: $SPECGATE_HOME/keys (`specgate keys add`)
    metrics_requires_key: bool = False  # /metrics then needs a valid key (any key)
    # Wrong keys per client address (an IPv6 one by its /64) within the
    # window; past that the address gets 429 + Retry-After for wrong keys and
    # for keys needing the slow check of an old PBKDF2 record (valid fast keys
    # still pass: a NAT may hide honest clients behind the same address).
    failed_auth_limit: int = Field(10, ge=1)
    failed_auth_window_s: float = Field(60.0, gt=0)
    # Addresses tracked at most; beyond that, new ones share one allowance.
    failed_auth_max_clients: int = Field(4096, ge=1)
    # A loopback client sending no key may read GET /admin/status (the admin
    # page, read-only: no keys, no log lines, no actions) even with keys.
    # Turn off where a reverse proxy on this machine makes every client loopback.
    loopback_status: bool = True

    @property
    def keys_path(self) -> Path:
        from specgate.engines.home import keys_file

        return Path(self.keys_file).expanduser() if self.keys_file else keys_file()


class LlamaServerConfig(_Strict):
    # llama-server to run; default: PATH, then `specgate install-llama-server`'s build.
    binary: str | None = None


class DistributedConfig(_Strict):
    """One model over several machines (engines/distributed/lockstep.py): specgate runs
    under `mlx.launch`, rank 0 serves the API, the others follow its steps."""

    mode: Literal["tensor", "pipeline"] = "tensor"  # every layer split, or the layers in order
    backend: Literal["ring", "jaccl", "mpi"] = "ring"  # mx.distributed's; mlx.launch --backend
    hostfile: str | None = None  # mlx.launch --hostfile (what `specgate serve` says to run)
    # Rank 0 fails the model when another rank's connection closes or it sends
    # no heartbeat (one a second) for this long: a rank stuck or cut off.
    rank_timeout_s: float = Field(15.0, gt=0, le=3600)


ThinkingBudgetTokens = Annotated[int, Field(ge=0)] | None


class ThinkingConfig(_Strict):
    """How a request to think maps onto a reasoning model's thinking
    (gateway/api/thinking.py): the thinking tokens allowed before the
    closing marker is forced, per effort a request names (OpenAI
    `reasoning_effort`, Responses `reasoning.effort`; "none" and "minimal"
    turn thinking off). null: no budget but max_tokens. Anthropic's
    `budget_tokens` is taken as sent."""

    low: ThinkingBudgetTokens = 1024
    medium: ThinkingBudgetTokens = 4096
    high: ThinkingBudgetTokens = 16384
    xhigh: ThinkingBudgetTokens = None
    # A request that turns thinking on without a budget or an effort
    # (Anthropic's `adaptive`, `chat_template_kwargs.enable_thinking`). A
    # request that asks nothing keeps the template's default and no budget.
    default: ThinkingBudgetTokens = None


# Settings that once sat on the model, now each engine's own (the model's
# `<engine>:` key): old key -> (engine, its field) for each engine it set.
# A config that still uses one keeps working: the value goes to those of
# the engines that the model lists (unless the engine's own key sets it).
_MOVED_SETTINGS = {
    "mtp_depth": (("mlx_mtp", "depth"), ("mlx_assistant", "depth"), ("llamacpp_mtp", "depth"),
                  ("mlx_mtp_ngram", "mtp_depth")),
    "block_depth": (("mlx_dflash", "depth"), ("mlx_dspark", "depth")),
    "ngram_depth": (("mlx_ngram", "depth"), ("mlx_mtp_ngram", "depth"), ("llamacpp_ngram", "depth")),
    "llamacpp.ngram_type": (("llamacpp_ngram", "type"),),
}  # fmt: skip


def _moved_settings(raw):
    """A model's raw YAML with _MOVED_SETTINGS' old keys moved to the engines'."""
    if not isinstance(raw, dict):
        return raw
    raw = dict(raw)
    given = {}
    for old in _MOVED_SETTINGS:
        section, _, key = old.rpartition(".")
        holder = raw.get(section) if section else raw
        if isinstance(holder, dict) and key in holder:
            if section:
                raw[section] = holder = dict(holder)
            given[old] = holder.pop(key)
    listed = raw.get("engines")
    for old, value in given.items():
        for engine, key in _MOVED_SETTINGS[old]:
            if isinstance(listed, list) and engine in listed:
                own = raw.get(engine)
                own = dict(own) if isinstance(own, dict) else {}
                own.setdefault(key, value)
                raw[engine] = own
    return raw


class _ModelConfig(_Strict):
    """A model to serve. Each engine's own settings are fields named after
    the engine (`mlx_mtp: {depth: 3}`), added from the registry's records
    below (ModelConfig)."""

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")
    # "builtin:demo", a local model directory or a hub repo id ("org/name") for
    # the MLX engines; a .gguf file or "builtin:demo-gguf" for the llamacpp ones
    # (a .gguf file for MLX engines too: imported to MLX when it loads);
    # or where another tool keeps it: "ollama:NAME[:TAG]", "lmstudio:ORG/REPO[:QUANT]",
    # a GGUF repo in the hub cache "org/name:QUANT" (engines/checkpoints/sources.py).
    path: str = Field(min_length=1)
    # MLX: mlx_plain (batched plain decoding) is always there; mlx_mtp adds MTP
    # speculative decoding with the checkpoint's own head, mlx_dflash (or
    # mlx_dspark) with the DFlash (DSpark) drafter at `drafter`,
    # mlx_assistant with a Gemma-4 -assistant drafter at `drafter`, mlx_ngram
    # drafts copied from the context (any model), mlx_mtp_ngram copies where
    # the context has a match and asks the MTP head elsewhere. The policy
    # picks among them by measured speed; before anything is measured, in
    # engines/registry.py's order (MTP first). GGUF: llamacpp runs a plain
    # llama-server, llamacpp_mtp one with --spec-type draft-mtp,
    # llamacpp_ngram one with an n-gram --spec-type; list several to let the
    # policy choose per request (a process each, see
    # engines/llamacpp/engine.py). Default: mlx_plain, or llamacpp for a GGUF.
    # (The engines are engines/registry.py's records.)
    # Each listed engine's own settings are its key: `mlx_mtp: {depth: 3}`
    # (engines/settings.py says what each takes).
    engines: list[EngineName] = Field(default_factory=list)
    # The drafter engine's drafter: a DFlash (z-lab layout) or DSpark
    # (DeepSpec) directory, a Gemma-4 -assistant checkpoint (mlx_assistant),
    # or "builtin:demo-dflash"; for a GGUF model with llamacpp_mtp, a
    # Gemma-4 -assistant .gguf (llama-server -md).
    drafter: str | None = None
    # Tokens of prompt + completion; default: the model's max_position_embeddings.
    max_context: int | None = Field(None, gt=0)
    # Tokens a chat completion or a response generates when the request sets
    # no max_tokens / max_completion_tokens / max_output_tokens (at most
    # what the context leaves); /v1/completions keeps OpenAI's 16.
    default_max_tokens: int = Field(4096, gt=0)
    # Strings that end a chat reply of this model (chat completions,
    # messages, responses; not /v1/completions) as its end of turn does, a
    # natural end, besides a request's own stop strings (Ollama's `PARAMETER
    # stop`); never where a grammar holds the output (a forced tool call, a
    # JSON schema). For a model that seldom ends a turn by itself, as the
    # demo (trained on Python files, never on chats): coding agents take a
    # reply cut at max_tokens for an error.
    reply_stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=16)
    max_concurrent: int = Field(8, gt=0, le=256)  # requests decoded together
    max_queue: int = Field(64, ge=0)  # waiting beyond that -> 429
    # Longest wait in the admission queue before 503 + Retry-After.
    max_queue_wait_s: float = Field(120.0, gt=0)
    # Prefix-cache entries kept in RAM (0: no prefix cache); bytes are capped
    # for all models together by `prefix_cache.ram_bytes`.
    prefix_cache_size: int = Field(64, ge=0)
    # Small-M verify kernels (kernels/): "auto" routes a quantized model's
    # speculative verify forwards through the kernels this machine proved
    # correct and faster per shape (kernels/guard.py); "off": stock MLX always.
    kernels: Literal["auto", "off"] = "auto"
    # MLX engines: load a quantized checkpoint's layers as dense bfloat16.
    # For MLX's CPU backend (mlx[cpu] on Linux), where a quantized forward
    # over k tokens costs k single-token forwards, so verifying drafts saves
    # nothing; dense ones verify 8 tokens for about 3.6 (measured: SmolLM2
    # 135M on 2 x86 cores). Those layers take 4x the memory. Off: on Metal,
    # quantized weights are the faster ones.
    dequantize: bool = Field(False, description="MLX engines: quantized layers loaded as dense "
                             "bfloat16 (for MLX's CPU backend, where a quantized verify costs "
                             "one forward per token)")
    # The KV cache quantized to 4 or 8 bits (mlx-lm's quantized cache; MLX
    # engines: engines/forwards/quantized_kv.py; llama.cpp engines: its
    # --cache-type-k/-v q8_0 or q4_0): about 0.53x (8) or 0.28x (4) the
    # memory of a bfloat16 cache, for long contexts on a shared box. Every
    # engine decodes over the same quantized cache, so speculation stays
    # exact against plain decoding with it.
    kv_bits: Literal[4, 8] | None = Field(None, description="KV cache quantized to 4 or 8 bits; "
                                          "default: not quantized")  # fmt: skip
    kv_group_size: Literal[32, 64, 128] = Field(64, description="kv_bits: values per scale and "
                                                "bias (a smaller one where the head dimension "
                                                "needs it)")  # fmt: skip
    # When the model loads: at start ("boot"), or at its first request
    # ("on_demand"; the request waits, as in the admission queue).
    load: Literal["boot", "on_demand"] = "boot"
    # Unload after this long with no request (any engine kind); it loads
    # again on the next. Default: stay loaded.
    idle_ttl_s: float | None = Field(None, gt=0)
    # Never unloaded to make room for another model, nor for being idle.
    pin: bool = False
    distributed: DistributedConfig | None = None
    llamacpp: LlamaServerSettings = Field(default_factory=LlamaServerSettings)
    # The chat template to render chats with instead of the checkpoint's: a
    # Jinja file's path, or the template itself (text with `{{` or `{%`).
    # For a base model that has none (chat APIs answer 400 until it has one);
    # MLX engines and llama-server (--chat-template-file) both use it.
    chat_template: str | None = Field(None, min_length=1)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    # What it answers: generation (chat, completions, messages, responses),
    # embeddings (/v1/embeddings, Ollama's /api/embed) or rerank scores
    # (/v1/rerank), on its in-process plain engine's weights
    # (engines/embedding/). Default: embed for a checkpoint that declares its
    # pooling (sentence-transformers' modules.json), else generate.
    task: Task | None = Field(None, description="generate, embed or rerank; default: embed for "
                              "a checkpoint with sentence-transformers' modules.json, else generate")
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings,
                                         description=EmbeddingSettings.__doc__)
    thinking: ThinkingConfig = Field(default_factory=ThinkingConfig, description=ThinkingConfig.__doc__)
    # Tools for a model whose chat template has no tool support. null (the
    # default): a request with `tools` is a 400. "default": specgate lists
    # the tools in its own tool-use system prompt, renders earlier calls and
    # their results as text in the same syntax, and holds the output to
    # text and calls whose arguments follow each tool's schema
    # (gateway/api/tools.py, tools_as_text), as LM Studio answers such requests.
    tool_prompt: Literal["default"] | None = Field(
        None, description="Tools on a chat template without tool support: null (a 400) or "
        "\"default\" (specgate's tool-use prompt and a grammar for the calls)")

    @property
    def is_gguf(self) -> bool:
        # By the file's magic, not its name: Ollama's blobs have no suffix.
        from specgate.engines.checkpoints.sources import names_gguf

        return self.path == BUILTIN_DEMO_GGUF or names_gguf(self.path)

    @property
    def format(self) -> registry.Format:
        """The format its engines read: a GGUF file listed for MLX engines is
        imported into an MLX checkpoint when it loads (engines/checkpoints/gguf_import/)."""
        if self.is_gguf and not (self.engines and registry.record(self.engines[0]).format.in_process):
            return registry.GGUF
        return registry.MLX

    @property
    def imports_gguf(self) -> bool:
        return self.is_gguf and self.format == registry.MLX

    @model_validator(mode="before")
    @classmethod
    def _older_keys(cls, raw):
        return _moved_settings(raw)

    @field_validator("path")
    @classmethod
    def _path_is_there(cls, v: str) -> str:
        # A hub repo id ("org/name") is looked up when the model loads.
        return _checked_location(v, (BUILTIN_DEMO, BUILTIN_DEMO_GGUF))

    @field_validator("chat_template")
    @classmethod
    def _template_readable(cls, value: str | None) -> str | None:
        if value is not None and not _inline_template(value):
            path = Path(value).expanduser()
            if not path.is_file():
                raise ValueError(f"chat_template: {value} is neither a file nor a Jinja template "
                                 "(inline text with {{ or {%)")
        return value

    def chat_template_text(self) -> str | None:
        """The configured chat template's text (read from its file), or None."""
        value = self.chat_template
        if value is None or _inline_template(value):
            return value
        return Path(value).expanduser().read_text(encoding="utf-8")

    @field_validator("drafter")
    @classmethod
    def _drafter_is_there(cls, v: str | None) -> str | None:
        # Drafters are read from a local directory only (engines/drafting/dflash/ and dspark/).
        return None if v is None else _checked_location(v, (BUILTIN_DEMO_DFLASH,), local_only=True)

    @model_validator(mode="after")
    def _engines_fit_the_format(self) -> _ModelConfig:
        _task_fits(self)
        if self.is_gguf and self.engines:
            _gguf_engines_fit(self)
        fmt = self.format
        if not self.engines:
            self.engines = [r.name for r in registry.records(fmt) if r.default]
        fits = registry.names(fmt)
        wrong = [e for e in self.engines if e not in fits]
        if wrong:
            raise ValueError(
                f"engines {wrong} cannot serve {fmt.description} ({self.path}); use {' / '.join(fits)}"
            )
        if len(set(self.engines)) != len(self.engines):
            raise ValueError(f"engines lists one twice: {self.engines}")
        for name in self.engines:  # e.g. one drafter per model: dflash, dspark or assistant
            if any(e in self.engines for e in registry.excludes(name)):
                listed = [e for e in registry.names()
                          if e == name or (e in registry.excludes(name) and e in self.engines)]
                raise ValueError(f"one {registry.record(name).exclusive} per model: "
                                 f"{' or '.join(listed)}, not {'both' if len(listed) == 2 else 'several'}")
        if self.dequantize and not fmt.in_process:
            raise ValueError(f"dequantize: for MLX engines; {' / '.join(self.engines)} run "
                             "llama.cpp, which reads the GGUF's own types")
        if self.distributed is not None:
            _distribution_fits(self)
        if self.pin and self.idle_ttl_s is not None:
            raise ValueError("a pinned model is never unloaded: `pin` or `idle_ttl_s`, not both")
        needs = [r.name for r in registry.records(self.format) if r.needs == "drafter"]
        takes = needs + [r.name for r in registry.records(self.format) if r.accepts_drafter]
        if any(e in needs for e in self.engines) and self.drafter is None:
            raise ValueError(f"{' / '.join(e for e in self.engines if e in needs)} needs a `drafter`")
        if self.drafter is not None and not any(e in takes for e in self.engines):
            raise ValueError(f"`drafter` goes with an engine that drafts with it ({' / '.join(takes)})")
        if self.drafter is not None and (fmt == registry.GGUF) != self.drafter.lower().endswith(".gguf"):
            raise ValueError(f"a GGUF model's drafter is a .gguf file (llama-server -md), an MLX "
                             f"model's a checkpoint directory; got {self.drafter}")
        unused = [n for n in self.model_fields_set if n in _ENGINE_FIELDS and n not in self.engines]
        if unused:
            raise ValueError(f"settings for {' and '.join(sorted(unused))}, which `engines` does not "
                             f"list ({', '.join(self.engines)})")
        return self

    def engine_settings(self) -> dict[str, EngineSettings]:
        """Each listed engine's own settings, as validated."""
        return {name: getattr(self, name) for name in self.engines if name in _ENGINE_FIELDS}


def _task_fits(mc: _ModelConfig) -> None:
    """Embeddings and rerank run on the weights of the in-process plain
    engine (always built for an MLX checkpoint; a GGUF is imported): no
    speculative engine, no llama-server, one machine."""
    if mc.task in (None, "generate"):
        if "embedding" in mc.model_fields_set and mc.task == "generate":
            raise ValueError("`embedding` settings go with task embed or rerank")
        return
    plain = [r.name for r in registry.records(registry.MLX) if r.always]
    if not mc.engines:
        mc.engines = plain
    if mc.engines != plain:
        raise ValueError(f"task {mc.task} runs on {' / '.join(plain)} alone (the model's own "
                         f"forward, no drafting); engines lists {', '.join(mc.engines)}")  # fmt: skip
    if mc.distributed is not None:
        raise ValueError(f"task {mc.task}: a model over several ranks serves generation only")
    if mc.kv_bits is not None:
        raise ValueError(f"kv_bits: a task {mc.task} model keeps no KV cache (one forward a batch)")


# One field per registry record with settings of its own, named after the
# engine and typed by the record's class: a new per-engine option is a field
# in engines/settings.py, nothing here. (The `llamacpp` engine has none; the
# model's `llamacpp:` section is how every llama.cpp engine's process runs.)
# Records registered after this module loads (tests) get their defaults.
_ENGINE_FIELDS = {r.name: r.settings for r in registry.records() if r.settings.model_fields}
ModelConfig = create_model(
    "ModelConfig", __base__=_ModelConfig, __module__=__name__, __doc__=_ModelConfig.__doc__,
    **{name: (cls, Field(default_factory=cls, description=cls.__doc__))
       for name, cls in _ENGINE_FIELDS.items()},
)  # fmt: skip


def _gguf_engines_fit(mc: _ModelConfig) -> None:
    """A GGUF file's engines: llama.cpp's, or MLX ones that serve it imported
    (engines/checkpoints/gguf_import/), never both (each would hold its own
    copy of the weights; list two models with one path instead)."""
    in_process = [e for e in mc.engines if registry.record(e).format.in_process]
    if not in_process:
        return
    other = [e for e in mc.engines if e not in in_process]
    if other:
        raise ValueError(f"a GGUF model's engines are llama.cpp's ({' / '.join(other)}) or MLX ones "
                         f"({' / '.join(in_process)}, serving it imported), not both: list the "
                         "file under two model ids, one for each")  # fmt: skip
    if mc.path == BUILTIN_DEMO_GGUF:
        raise ValueError(f"the MLX engines serve the demo as {BUILTIN_DEMO}, not {BUILTIN_DEMO_GGUF}")
    heads = [e for e in in_process if registry.record(e).needs == "mtp_head"]
    if heads:
        raise ValueError(f"{' / '.join(heads)} drafts with the checkpoint's MTP head, which a GGUF file "
                         "imported to MLX does not carry; use mlx_plain / mlx_ngram, or llamacpp_mtp")  # fmt: skip
    from specgate.engines.checkpoints.sources import resolve_source

    file = resolve_source(mc.path) or Path(mc.path).expanduser()  # ollama:, org/name:QUANT too
    if file.is_file():
        from specgate.engines.checkpoints.gguf_import import importable

        why = importable(file)
        if why:
            raise ValueError(f"{' / '.join(in_process)} cannot serve {mc.path}: {why}")


def _distribution_fits(mc: _ModelConfig) -> None:
    """What a model over several ranks may be, for now: its engines those
    tested in lockstep (the registry's `distributed`), loaded at start and
    never unloaded (every rank holds its shard for the process's life)."""
    if mc.is_gguf:
        raise ValueError("distributed: MLX models only (llama.cpp has its own RPC backend)")
    spread = [r.name for r in registry.records(mc.format) if r.distributed]
    other = [e for e in mc.engines if e not in spread]
    if other:
        raise ValueError(f"distributed: engines {other} do not run over several ranks yet; "
                         f"use {' / '.join(spread)}")
    if mc.dequantize:  # its shards' layer types are not mlx-lm's dequantize's
        raise ValueError("distributed: not with `dequantize`")
    if mc.load != "boot" or mc.idle_ttl_s is not None:
        raise ValueError("distributed: the model loads at start and stays (no `load: on_demand`, "
                         "no `idle_ttl_s`)")
    mc.pin = True  # never evicted: its other ranks hold their shards until specgate stops


def _inline_template(value: str) -> bool:
    return "{{" in value or "{%" in value


def _checked_location(value: str, builtins: tuple[str, ...], *, local_only: bool = False) -> str:
    """`value` if it is one of `builtins`, a path that exists, or (unless
    `local_only`) what can only be a hub repo id; else a config error that
    says what is not there, so a typo fails at start and not as a hub error."""
    from specgate.engines.checkpoints.locate import looks_local

    if value.startswith(BUILTIN_PREFIX):
        if value not in builtins:
            raise PydanticCustomError("unknown_builtin", "no such builtin here; use {known}",
                                      {"known": " or ".join(builtins)})
        return value
    local = Path(value).expanduser()
    if not local_only and not local.exists():
        _store_has(value)
    if (local_only or looks_local(value)) and not local.exists():
        where = ("" if Path(value).is_absolute() else f" (as {local})" if value.startswith("~")
                 else f" (relative to the working directory {Path.cwd()})")
        also = "; a drafter must be a local directory" if local_only else ""
        raise PydanticCustomError("path_missing", "does not exist{where}{also}",
                                  {"where": where, "also": also})
    return value


def _store_has(value: str) -> None:
    """A config error unless a store name (`ollama:`, `lmstudio:`, a GGUF
    repo's `org/name:QUANT`: engines/checkpoints/sources.py) names a model
    that is there now; serving never downloads one."""
    from specgate.engines.checkpoints.sources import SourceError, resolve_source

    try:
        resolve_source(value)
    except SourceError as e:
        raise PydanticCustomError("model_source", "{why}", {"why": str(e)}) from None




class PrefixCacheConfig(_Strict):
    """The in-process engines' prefix cache (engines/cache/prefix_cache.py)."""

    # RAM for every model's cache together, out of server.memory_budget:
    # "16GiB", or "10%" of physical memory; default: an eighth of the budget.
    ram_bytes: RamSize | None = None
    # The disk tier under $SPECGATE_HOME/prefix-cache, kept across restarts; 0: none.
    disk_bytes: ByteSizeOrZero = Field("8GiB", validate_default=True)
    disk_min_tokens: int = Field(256, ge=1)  # shorter prefixes are not written to disk
    # Tokens between snapshots of a hybrid model's state in a long prompt
    # (beside those at message boundaries); 0: message boundaries only.
    snapshot_interval: int = Field(4096, ge=0)
    # Across API keys: "system" shares a system prompt's (and tools') state
    # between keys that send exactly the same one, everything else per key;
    # "none": everything per key; "all": one cache for everyone.
    share: Literal["system", "none", "all"] = "system"


LOCAL_NODE = "local"  # this node, in routing metrics and X-Specgate-Node


class PeerConfig(_Strict):
    """Another specgate this one routes requests to (gateway/cluster/peers.py):
    its models are listed here, and a request for one goes to the least
    loaded healthy node that serves it, this one included."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")  # a metrics label
    url: str = Field(pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")  # e.g. http://10.0.0.2:8000
    # The API key this node presents there (one of the peer's keys; its model
    # allow-list limits what is routed). Clients' keys are checked here and
    # never sent on. Unset: the peer is an open loopback server.
    key: SecretStr | None = None
    health_interval_s: float = Field(2.0, gt=0)  # between checks of a healthy peer
    max_backoff_s: float = Field(30.0, gt=0)  # longest wait between checks of a down one
    connect_timeout_s: float = Field(3.0, gt=0)  # a check, or the start of a request
    # A whole check, connect to last byte (a peer trickling its answer is down).
    check_timeout_s: float = Field(5.0, gt=0)
    # Its /v1/models body is read up to this much; a longer one marks it down.
    max_models_body: ByteSize = Field("1MiB", gt=0, validate_default=True)
    # Longest silence within a proxied response (a long prefill answers late).
    read_timeout_s: float = Field(600.0, gt=0)

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


class Budgets(NamedTuple):
    """server.memory_budget and the prefix cache's share of it, in bytes;
    the rest is the models'."""

    memory: int
    prefix_cache: int

    @property
    def models(self) -> int:
        return self.memory - self.prefix_cache


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class Config(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)
    llama_server: LlamaServerConfig = Field(default_factory=LlamaServerConfig)
    # A node with peers may serve no model itself (a front for the others).
    models: list[ModelConfig] = Field(default_factory=list)
    peers: list[PeerConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_ids(self) -> Config:
        if not self.models and not self.peers:
            raise ValueError("models: at least one model (or `peers` to route to)")
        for what, ids in (("model ids", [m.id for m in self.models]),
                          ("peer names", [p.name for p in self.peers])):  # fmt: skip
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            if dupes:
                raise ValueError(f"{what} must be unique; repeated: {', '.join(dupes)}")
        spread = [m.id for m in self.models if m.distributed is not None]
        if len(spread) > 1:
            raise ValueError(f"one distributed model per server; got {', '.join(spread)}")
        if any(p.name == LOCAL_NODE for p in self.peers):
            raise ValueError(f"peer name '{LOCAL_NODE}' is this node's own label")
        return self

    def budgets(self) -> Budgets:
        """The memory budget (default 3/4 of physical memory) and the prefix
        cache's RAM out of it (default an eighth of the budget)."""
        from specgate.engines.memory import physical_memory

        memory = self.server.memory_budget
        memory = physical_memory() * 3 // 4 if memory is None else memory
        cache = self.prefix_cache.ram_bytes
        return Budgets(memory, memory // 8 if cache is None else cache)

    @model_validator(mode="after")
    def _budgets_fit(self) -> Config:
        budgets = self.budgets()
        if budgets.prefix_cache >= budgets.memory:
            default = " (default: 75% of physical memory)" * (self.server.memory_budget is None)
            raise PydanticCustomError(
                "budget", "prefix_cache.ram_bytes {cache} leaves nothing of server.memory_budget "
                "{memory}{default} for models: the prefix cache's RAM comes out of the memory "
                "budget; make it smaller, or the budget larger",
                {"cache": _gib(budgets.prefix_cache), "memory": _gib(budgets.memory), "default": default})
        return self

    @field_validator("models", mode="before")
    @classmethod
    def _models_is_list(cls, v):
        if isinstance(v, dict):
            raise ValueError("models must be a list of entries, each starting with '- id: ...'")
        return v


class ConfigError(Exception):
    """A config that cannot be used; the message says where and why."""


# The demo's replies end at a blank line: it seldom ends a turn by itself
# (an agent's turn would run to its max_tokens, an error to Claude Code).
DEMO_REPLY_STOP = ("\n\n",)


def default_config() -> Config:
    """What `specgate serve` with no arguments serves."""
    return Config(
        models=[ModelConfig(id=DEFAULT_MODEL_ID, path=BUILTIN_DEMO,
                            engines=[registry.MLX_PLAIN, registry.MLX_MTP],
                            reply_stop=list(DEMO_REPLY_STOP))]  # fmt: skip
    )


# A value quoted in an error: its start (a list of a thousand entries is not
# repeated back whole).
_quote = reprlib.Repr()
_quote.maxstring, _quote.maxother, _quote.maxlist, _quote.maxlevel = 500, 200, 10, 3


def _format(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = (f" (got {_quote.repr(e['input'])})"
               if "input" in e and not isinstance(e["input"], dict) else "")  # fmt: skip
        lines.append(f"{source}: {where}: {e['msg']}{got}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "<config>") -> Config:
    if data is None:
        raise ConfigError(f"{source}: the file is empty; it needs at least a 'models:' list")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with 'server' and 'models' at the top")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(source, e)) from None


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; past this it is something else
MAX_CONFIG_NODES = 100_000  # YAML nodes once aliases are expanded (a config: hundreds)


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses, before building anything, a document
    whose aliases expand past MAX_CONFIG_NODES nodes or that contains
    itself. Aliases within the bound (`&defaults` ... `<<: *defaults`) work."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node)
        return node


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes `root` holds once every alias is copied out, each
    shared node counted once (the work is linear in the file, whatever the
    expansion); YAMLError past the bound or for a node inside itself."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose children are being counted: their subtree
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])  # fmt: skip
        if counted:
            open_.discard(id(node))
            sizes[id(node)] = size = 1 + sum(sizes[id(c)] for c in children)
            if size > MAX_CONFIG_NODES:
                raise yaml.YAMLError(f"its aliases expand to more than {MAX_CONFIG_NODES} "
                                     "nodes; a config is far smaller (an alias bomb?)")  # fmt: skip
        elif id(node) in open_:
            raise yaml.YAMLError("an alias refers to a node that contains it")
        elif id(node) not in sizes:
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children)
    return sizes[id(root)]


def load_config(path: str | Path) -> Config:
    """ConfigError, saying why, for anything but a usable config file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is {raw[e.start]:#04x}); "
                          "a config is a YAML text file") from None  # fmt: skip
    try:
        data = yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply for a config") from None
    return parse_config(data, str(path))


SCHEMA_ID = "https://specgate.dev/specgate.schema.json"  # a name for editors, never fetched


def json_schema() -> dict:
    """The config file's JSON Schema (`specgate config schema`;
    deploy/specgate.schema.json is this, kept in step by a test), for
    editors. What a schema cannot say (paths that must exist, one block
    drafter per model) is still checked by `specgate config check`."""
    schema = Config.model_json_schema(mode="validation")
    # The registry's engine names, which validation reads at run time.
    model = schema["$defs"]["ModelConfig"]["properties"]
    model["engines"]["items"]["enum"] = list(registry.names())
    # The keys that moved to the engines' own settings, still read (_MOVED_SETTINGS).
    for old, where in _MOVED_SETTINGS.items():
        section, _, key = old.rpartition(".")
        props = schema["$defs"][model[section]["$ref"].rsplit("/", 1)[-1]]["properties"] if section else model
        moved = ", ".join(f"{engine}.{field}" for engine, field in where)
        props[key] = {"deprecated": True, "description": f"Moved: now {moved}.",
                      **{k: v for k, v in schema["$defs"][_ENGINE_FIELDS[where[0][0]].__name__][
                          "properties"][where[0][1]].items() if k not in ("title", "description")}}
    # A model to serve, or peers to route to (Config._unique_ids).
    schema["anyOf"] = [{"required": [key], "properties": {key: {"minItems": 1}}}
                       for key in ("models", "peers")]  # fmt: skip
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": "specgate config", **schema}  # fmt: skip
