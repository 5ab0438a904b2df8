"""The types that cross seams: gateway -> policies -> engines.

Everything the gateway hands an engine, and everything an engine hands back,
is defined here. Nothing in this module imports MLX, FastAPI or a policy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

# A decoding method: what an engine's record in engines/registry.py says it
# serves ("mtp", "dflash", ...; registry.methods() lists them). A string, so
# a new method is a record there and nothing here.
Method = str
PLAIN: Method = "none"  # plain decoding: no drafts

# The closed set of reasons a plan can give. Metrics label by these, so the
# set must stay small and fixed.
Reason = Literal[
    "spec_on",
    "concurrency",
    "penalties",
    "long_context",
    "small_model",
    "no_drafter",
    "measured_loss",
    "forced_by_request",
    "unsupported_params",  # the speculative engine cannot honour a sampling parameter
    "request_loss",  # this request's own rounds ran below its bound (policies/request_guard.py)
    "kernels_proving",  # its verify kernels are proved in the background: stock verify until then
    "near_end",  # plain decoding: too few tokens left for a switch to speculation to pay
]

# Where a plan's numbers came from: a fixed rule (an override, a missing
# drafter, a configured threshold, nothing measured yet), live estimates of
# this model's costs on this machine, `specgate tune`'s prior, or exploration
# (a request trying a plan the estimates do not favour, to keep them fresh).
Source = Literal["rule", "live", "tune", "explore"]

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class OutputConstraint:
    """Output held to a grammar (engines/grammar/matcher.py builds these).

    grammar: llguidance's form, compiled from a JSON schema or a Lark
    grammar; json_schema: the schema as JSON text where the grammar is one
    JSON value between the fixed texts `prefix` and `suffix` (llama-server
    takes the schema in its own form, the prefix as prompt), None for other
    grammars; param: the request parameter that asked for it, for errors."""

    grammar: str
    json_schema: str | None
    param: str
    prefix: str = ""
    suffix: str = ""


@dataclass(frozen=True)
class ThinkingFormat:
    """How a model marks its thinking, as mlx-lm knows it
    (`mlx_lm.tokenizer_utils._infer_thinking`: `<think>`/`</think>` and the
    other pairs its parsers know), and whether its chat template can turn
    thinking on and off (`enable_thinking`).

    Token sequences are the markers as the tokenizer writes them (one token
    each for Qwen3.x); `grammar_after_thinking` says whether the engine
    holds an answer's grammar only after free thinking (the in-process
    engines, engines/grammar/thinking.py) or the whole output (llama-server:
    there a request with a grammar is rendered with thinking off)."""

    start: str
    end: str
    start_tokens: tuple[int, ...]
    end_tokens: tuple[int, ...]
    switchable: bool  # the template reads `enable_thinking`
    grammar_after_thinking: bool = True

    def opened_by(self, prompt: list[int]) -> bool:
        """Whether the prompt ends inside thinking: in its tail (the
        generation prompt's, where templates such as Qwen3.5's open `<think>`)
        the last opening marker comes after the last closing one, as
        mlx-lm's server reads it. Only the tail: an earlier turn's thinking
        is history, and a 100k-token prompt is not scanned."""
        tail = prompt[-TAIL_TOKENS:]
        return _rfind(tail, self.start_tokens) > _rfind(tail, self.end_tokens)


TAIL_TOKENS = 64  # a generation prompt is far shorter


def _rfind(tokens: list[int], sequence: tuple[int, ...]) -> int:
    n = len(sequence)
    if n == 0:
        return -1
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i : i + n]) == sequence:
            return i
    return -1


@dataclass(frozen=True)
class ThinkingBudget:
    """A request's thinking, as the engines hold it to its budget
    (engines/grammar/thinking.py): the markers' tokens; whether the prompt
    opened the thinking (else the output may open it with its first
    tokens); how many thinking tokens may come before the closing marker is
    forced (None: no budget; 0: it is forced at once). An answer grammar
    (`SamplingParams.constraint`) then applies from the token after the
    closing marker."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    opened: bool
    budget: int | None
    # The markers as text, for llama-server's own budget sampler.
    start_text: str = ""
    end_text: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature == 0 means greedy.

    Order of application (shared by every engine, see engines/sampling.py):
    penalties -> grammar mask -> temperature -> top-k -> top-p -> min-p -> sample.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    # Applied after the penalties, before temperature and truncation, to
    # target and drafts alike (engines/grammar/matcher.py).
    constraint: OutputConstraint | None = None
    # The thinking's budget, and where an answer grammar starts; None where
    # the request leaves the model's thinking alone.
    thinking: ThinkingBudget | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class Plan:
    """How one request (or one round of it) is decoded, and why."""

    engine: str
    method: Method
    depth: int
    reason: Reason
    source: Source = "rule"

    def header(self) -> str:
        """The value of the X-Specgate-Plan response header."""
        return f"method={self.method};depth={self.depth};reason={self.reason};source={self.source}"


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, preprocessed for its model's vision tower
    (engines/vision/): the prompt holds `length` placeholder ids from
    `start`, whose embeddings the tower's output replaces."""

    start: int
    grid: tuple[int, int, int]  # (t, h, w) patches, before the 2x2 merge
    length: int  # its tokens in the prompt
    pixels: Any  # np.ndarray (patches, features), the processor's output
    digest: str  # sha256 of the image as sent: what the prefix cache keys on

    @property
    def end(self) -> int:
        return self.start + self.length

    def key_id(self) -> int:
        """A negative id standing for this image in prefix-cache keys."""
        return -1 - int(self.digest[:15], 16) % (2**31 - 2)


@dataclass
class GenerationRequest:
    """A fully parsed request: the prompt is already tokenized."""

    request_id: str
    model: str
    prompt_tokens: list[int]
    sampling: SamplingParams
    max_tokens: int
    plan: Plan
    # Token ids that end generation (the model's EOS set). Stop *strings* are
    # matched on text by the gateway, which then closes the stream.
    stop_token_ids: frozenset[int] = frozenset()
    # The prefix cache (engines/cache/prefix_cache.py): whose entries it may use,
    # where in the prompt its messages end (token offsets; the engines keep
    # a snapshot there where the model's caches cannot be cut back), and the
    # end of its system prompt, whose snapshot every scope may share.
    cache_scope: str = ""
    boundaries: tuple[int, ...] = ()
    shared_prefix: int = 0
    # Its images, in prompt order (a vision-language model's request).
    images: tuple[ImageInput, ...] = ()

    def cache_key(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` (a prefix of this request's sequence) as the prefix cache
        keys them: each image's placeholders stand for that image alone, so
        two prompts alike but for an image share nothing past it."""
        key = list(tokens)
        for image in self.images:
            if image.start < len(key):
                key[image.start : min(image.end, len(key))] = [image.key_id()] * (
                    min(image.end, len(key)) - image.start)
        return key

    @property
    def images_end(self) -> int:
        """Where the prompt's last image ends (0: no image)."""
        return max((image.end for image in self.images), default=0)


@dataclass(frozen=True)
class CacheSettings:
    """The server's `prefix_cache` section, as the engines take it
    (engines/cache/prefix_cache.py)."""

    ram_bytes: int | None = None  # every model's cache together; None: 1/8 of physical memory
    disk_bytes: int = 8 << 30  # the disk tier's budget; 0: no disk tier
    disk_min_tokens: int = 256  # shorter entries stay in RAM only
    snapshot_interval: int = 4096  # tokens between a hybrid's snapshots in a long prompt


@dataclass(frozen=True)
class HeldMemory:
    """Memory an engine holds, measured: `holder` names what holds it, so
    weights several engines share (one model's in-process engines) count
    once. kind: "weights" (the target's) or "drafter" (a head or drafter);
    a child process (llama-server) adds "kv" (its KV cache) and "resident"
    (its measured resident size: the same memory again, as the OS counts it)."""

    holder: str
    kind: str
    nbytes: int


@dataclass(frozen=True)
class MessageBoundaries:
    """Token offsets in a rendered chat prompt (0: none): where the system
    prompt (with the tools) ends, and where the conversation before the
    newest message ends."""

    system: int = 0
    history: int = 0


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class PrefillProgress:
    """How far a request's prompt is in the cache, sent before its first
    token: once the prompt was looked up in the prefix cache (`processed`
    then counts what the lookup served: the usage's cache reads are known
    from here, and an Anthropic stream's message_start reports them), and
    between prefill chunks, so that a long prompt's stream tells the client
    it is alive, and how far along (gateway/api/chat.py). Engines that
    prefill in one piece and keep no prefix cache send none."""

    processed: int  # prompt tokens in the cache, cached ones included
    total: int  # the prompt's tokens
    cached: int = 0  # of them, served from the prefix cache


@dataclass
class TokenEvent:
    """Tokens the engine committed, with the text they add.

    `text` may be empty while a multi-byte character is incomplete; the bytes
    arrive with a later event. The last event of a request has finish_reason.
    """

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RoundStats:
    """One decoding round, as the metrics and the policy's live costs see it.

    A speculative engine reports each round of one sequence; the plain engine
    reports each batch step (method "none", drafted 0) with `batch`
    sequences decoded together. `seconds` is 0 where the engine cannot time
    its rounds (llama-server reports sums)."""

    model: str
    method: Method
    drafted: int
    accepted_per_position: list[bool] = field(default_factory=list)
    verify_width: int = 1
    seconds: float = 0.0
    context_tokens: int = 0  # tokens in the sequence's cache before the round
    batch: int = 1
    # The drafts the round was planned for; a proposer that copies from the
    # context drafts fewer, or none, where nothing longer matched. None: as
    # many as it drafted.
    depth: int | None = None
    # Masked by a grammar (engines/grammar/matcher.py): a round then also waits for
    # its drafts and computes masks, so the policy learns its cost apart.
    constrained: bool = False
    # Its verify ran through the small-M kernels (kernels/hook.py): an engine
    # switches to them once proved, and the stock path's costs then no longer hold.
    kernels: bool = False

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def asked(self) -> int:
        """The drafts planned: positions past `drafted` count as misses."""
        return self.drafted if self.depth is None else max(self.depth, self.drafted)


@dataclass
class Handoff:
    """A request moving to another engine of its model at a step boundary.

    The last event an engine yields for a request it gives up (instead of a
    final TokenEvent): everything the next engine needs to continue the same
    sequence exactly. The trunk's caches hold tokens[:-1]; `pending` are
    committed tokens the client has not seen yet (the receiving engine emits
    them first). The sender evaluates every array in it first: a lazy MLX
    graph names its thread's stream, which the receiving thread lacks.
    """

    plan: Plan  # where the request goes, and why
    tokens: list[int]  # prompt + committed output
    generated: int  # output tokens committed, pending included
    cache: list  # the trunk's caches, as mlx-lm makes them
    detokenizer: object  # so the text continues where it stopped
    pending: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class LiveState:
    """What a planner sees of the engine at a round boundary."""

    active_requests: int
    waiting_requests: int
    context_tokens: int
    # Decoded to their end, their last events not yet taken by the gateway:
    # in neither count above (an engine's own; the model's planning state
    # takes them off the requests holding a slot).
    finished_requests: int = 0


@dataclass(frozen=True)
class Refusal:
    """Why an engine cannot serve a request's parameters exactly.

    The gateway then plans another engine of the model, or answers 400
    naming `param` when none can.
    """

    reason: Reason
    message: str
    param: str


class Planner(Protocol):
    """Implemented in policies/; engines call it at every round boundary."""

    def plan(self, state: LiveState) -> Plan: ...


class EngineOverloaded(Exception):
    """The engine's queue is full; the gateway answers 429 with Retry-After."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineError(RuntimeError):
    """The engine failed while serving a request; the gateway answers 500."""


class EngineStopped(EngineError):
    """The engine was stopped (shutdown, unload) while the request was in it;
    the gateway answers 503 (an error event on a stream that had started)."""


class Engine(Protocol):
    """One decoding engine serving one model."""

    name: str
    model_id: str
    max_context: int
    vocab_size: int

    async def encode(self, text: str) -> list[int]: ...

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        """Apply the model's chat template with the generation prompt.

        `tools` are OpenAI-shaped function tools ({"type": "function",
        "function": {...}}), handed to the template as its `tools` variable;
        messages may carry `tool_calls` (arguments as dicts), `reasoning_content`
        and `tool` roles. `template_kwargs`: further variables for the
        template (`enable_thinking`)."""
        ...

    async def message_boundaries(
        self, messages: list[dict], tools: list[dict] | None, tokens: list[int],
        template_kwargs: dict | None = None,
    ) -> MessageBoundaries:
        """Where, in `tokens` (render_chat's output for these messages), the
        system prompt and the messages before the newest end: the prefix
        cache keeps snapshots there. MessageBoundaries() where the engine
        keeps no prefix cache of its own."""
        ...

    async def check_constraint(self, constraint: OutputConstraint) -> None:
        """Compile the request's grammar where a native failure cannot harm
        the process (engines/grammar/sandbox.py), with this engine's
        tokenizer where it has one; raise GrammarError, naming the request's
        parameter, where it does not compile within the budget. Called
        before the request is admitted: what passes, the engine compiles."""
        ...

    async def chat_template(self) -> str | None:
        """The chat template's source text (None when there is no readable one):
        the gateway reads from it whether and how the model calls tools."""
        ...

    async def thinking_format(self) -> ThinkingFormat | None:
        """How the model marks its thinking, None for a model that does not think."""
        ...

    def refusal(self, sampling: SamplingParams) -> Refusal | None:
        """None when this engine serves these parameters exactly."""
        ...

    def images_refused(self) -> str | None:
        """None where this engine's model takes images, else why not."""
        ...

    async def prepare_images(self, tokens: list[int],
                             images: list[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:  # fmt: skip
        """A rendered prompt with one image marker per image, and the images
        as sent (encoded files) -> the prompt with each marker repeated once
        per image token, and the images as the engine takes them
        (GenerationRequest.images). Raises ValueError naming what is wrong
        with an image."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def generate(
        self, request: GenerationRequest, planner: Planner, resume: Handoff | None = None
    ) -> AsyncIterator[TokenEvent | RoundStats | Handoff | PrefillProgress]:
        """Admit a request (raising EngineOverloaded at once if the engine is
        full) and return its stream; closing the stream cancels it at the
        next step. Before its first token it may send PrefillProgress. With `resume`, continue a sequence another engine of the
        same model handed off; a stream may end in a Handoff of its own."""
        ...

    def live_state(self) -> LiveState: ...

    def memory(self) -> list[HeldMemory]:
        """What it holds now, measured (empty while it holds nothing, e.g. a
        llama-server not started yet)."""
        ...

    def problem(self) -> str | None:
        """Why this engine cannot serve right now (a stuck or dead worker or
        child process), or None when it can. /ready reports it; the engine
        recovers by itself where it can (a child is restarted)."""
        ...

    async def start(self) -> None: ...

    async def stop(self, grace_s: float | None = None) -> None:
        """End every request it holds (EngineStopped) and what it runs. A
        child process gets `grace_s` to exit after it is asked to, then is
        killed (None: the engine's own setting); an in-process worker ends
        within one step of its work, whatever the grace."""
        ...
