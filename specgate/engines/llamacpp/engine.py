"""The llamacpp engines: a GGUF model served by a managed llama-server.

One engine per process: `llamacpp` (plain decoding), `llamacpp_mtp`
(`--spec-type draft-mtp`) and `llamacpp_ngram` (an n-gram `--spec-type`,
drafting from the context). llama-server b11312 fixes speculation per
process: its per-request `speculative.*` fields are compiled out (`#if 0` in
tools/server/server-schema.cpp). So a model that lets the policy switch
speculation per request runs a process per mode; they map the same GGUF
file, so on the CPU the weights are one copy in the page cache and each
further process costs its KV cache and compute buffers.

Tokenization is the server's own (/tokenize, /apply-template): the GGUF's
vocabulary and chat template exactly as llama.cpp reads them, whatever model
it is (an in-process tokenizer would have to copy llama.cpp's dozens of
pre-tokenizers and its chat-template handling to be exact). Every process of
a model maps the same GGUF, so any of them tokenizes for all: each engine asks
its own process first, then its siblings (`tokenize_with`), each within a
short deadline, so one hung process does not hang the model's other engine.

Requests go to /completion as token ids and stream back chunk by chunk;
closing the stream closes the connection, which makes llama-server drop the
request. A request fails when llama-server makes no progress on it for
`progress_timeout` seconds: no token, and no prompt-progress event (asked for
with return_progress; llama-server sends one per batch of prompt it
evaluates, so a long prompt's prefill counts as progress, while its SSE pings,
sent by the HTTP thread whatever the decoding loop does, do not). After each
speculative request the server's `llamacpp:spec_decode_*` counters are read
and their growth becomes RoundStats (see adapter.rounds_from_counters).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

import httpx

from specgate.engines.base import (
    EngineError,
    EngineOverloaded,
    EngineStopped,
    GenerationRequest,
    HeldMemory,
    LiveState,
    MessageBoundaries,
    Method,
    OutputConstraint,
    Planner,
    PrefillProgress,
    Refusal,
    RoundStats,
    SamplingParams,
    ThinkingFormat,
    TokenEvent,
)
from specgate.engines.grammar.sandbox import SANDBOX
from specgate.engines.llamacpp.adapter import (
    SpecCounters,
    completion_body,
    parse_spec_counters,
    read_chunk,
    read_progress,
    refusal,
    rounds_from_counters,
    thinking_markers,
)
from specgate.engines.llamacpp.process import LlamaServer, LlamaServerError

log = logging.getLogger(__name__)

T = TypeVar("T")

# The longest wait for one process's /tokenize, /apply-template, /props or
# /metrics: llama-server answers them from its HTTP threads in milliseconds,
# even while it decodes, so a process that takes this long is hung and the
# next one is asked.
QUICK_TIMEOUT_S = 5.0
# A process that left one unanswered is asked last for this long (by then the
# health check has found it stuck and restarted it, or it was only slow).
UNANSWERED_LAST_S = 30.0


class LlamaCppEngine:
    def __init__(
        self,
        model_id: str,
        server: LlamaServer,
        *,
        name: str,
        method: Method,
        max_context: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_queue: int,
        start_at_boot: bool = True,
        read_timeout: float = 600.0,
        progress_timeout: float = 60.0,
        weights_bytes: int = 0,
        kv_bytes: int = 0,
        has_chat_template: bool = True,
        reproducible: bool = True,
    ):
        self.name = name
        self.method: Method = method
        self.model_id = model_id
        self.server = server
        self.max_context = max_context
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self.slots = server.spec.parallel
        self._max_in_flight = self.slots + max_queue
        self._start_at_boot = start_at_boot
        self._timeout = httpx.Timeout(read_timeout, connect=10.0)
        self._reproducible = reproducible  # (adapter.completion_body: Determinism)
        self.progress_timeout = progress_timeout
        self._siblings: list[LlamaServer] = []  # the model's other processes, for tokenizing
        # Read once (the GGUF's template and vocabulary do not change): (the format,)
        self._thinking: tuple[ThinkingFormat | None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._in_flight = 0
        self._stopping = False
        self._counters = SpecCounters()
        self._counters_start = 0  # which server start self._counters were read from
        self._counters_lock = asyncio.Lock()
        self._weights_bytes = weights_bytes  # the GGUF's tensors
        self._kv_bytes = kv_bytes  # its process's KV cache, allocated whole at start
        # False: neither the GGUF nor the config has a chat template, and
        # llama-server would render chats with its chatml fallback, which a
        # base model answers with garbage.
        self._has_chat_template = has_chat_template

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def speculative(self) -> bool:
        return self.server.spec.spec is not None

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        self._stopping = False
        self._client = httpx.AsyncClient(trust_env=False, timeout=self._timeout)
        if self._start_at_boot:
            await self.server.start()
            if self.speculative:
                self._counters, self._counters_start = await self._read_counters(), self.server.starts

    async def stop(self, grace_s: float | None = None) -> None:
        self._stopping = True  # what the stop cuts short ends with EngineStopped
        await self.server.stop(grace_s)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def problem(self) -> str | None:
        why = self.server.problem
        return f"llama-server ({self.name}) for model '{self.model_id}': {why}" if why else None

    def live_state(self) -> LiveState:
        active = min(self._in_flight, self.slots)
        return LiveState(active, self._in_flight - active, 0)

    def memory(self) -> list[HeldMemory]:
        """While its process runs: the weights (the GGUF's tensor bytes, held
        by the file: every process of the model maps the same pages), its KV
        cache (estimated from the GGUF's shape and its context: llama-server
        allocates it whole at start) and, apart, its resident size as
        measured (weights pages touched, KV, compute buffers)."""
        from specgate.engines.memory import process_rss

        pid = self.server.pid if self.server.alive else None
        if pid is None:
            return []
        held = [HeldMemory(f"gguf:{self.server.spec.model}", "weights", self._weights_bytes),
                HeldMemory(f"pid:{pid}:kv", "kv", self._kv_bytes)]
        if (rss := process_rss(pid)) is not None:
            held.append(HeldMemory(f"pid:{pid}", "resident", rss))
        return held

    def notes(self) -> list[str]:
        """What the operator should know that is not a problem: how its
        process had to be started (process.py's fallback)."""
        return [self.server.fallback] if self.server.fallback else []

    # -- the server's tokenizer ----------------------------------------------------

    def tokenize_with(self, siblings: list[LlamaServer]) -> None:
        """The model's other processes: they tokenize when this one cannot."""
        self._siblings = [s for s in siblings if s is not self.server]

    def _tokenizers(self) -> list[LlamaServer]:
        """Who to ask, best first: running ones without a problem, this engine's
        own first; then ones that must start first; then ones that just left a
        request unanswered; last, ones with a problem (restarting: asking one
        waits for its restart)."""
        now = time.monotonic()

        def rank(s: LlamaServer) -> tuple[bool, bool, bool]:
            unanswered = s.unanswered_at is not None and now - s.unanswered_at < UNANSWERED_LAST_S
            return s.problem is not None, unanswered, not s.running

        return sorted([self.server, *self._siblings], key=rank)

    async def _ask(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        """One answer from the first of the model's processes that gives one in time."""
        assert self._client is not None, "engine not started"
        failures = []
        for server in self._tokenizers():
            try:
                async with server.use() as url:
                    r = await self._client.request(method, url + path, json=body,
                                                   timeout=QUICK_TIMEOUT_S)
                server.unanswered_at = None
                return r
            except httpx.TimeoutException:
                server.unanswered_at = time.monotonic()
                failures.append(f"{_kind(server)}: no answer within {QUICK_TIMEOUT_S:g} s")
            except (httpx.TransportError, LlamaServerError) as e:
                failures.append(f"{_kind(server)}: {type(e).__name__}: {e}")
            log.warning("llama-server %s for %s: %s", path, self.model_id, failures[-1])
        raise EngineError(f"llama-server for model '{self.model_id}' is not answering: "
                          + "; ".join(failures))

    async def _post(self, path: str, body: dict) -> dict:
        r = await self._ask("POST", path, body)
        if r.status_code != 200:
            raise ValueError(_error_message(r.text))
        return r.json()

    async def encode(self, text: str) -> list[int]:
        return (await self._post("/tokenize", {"content": text, "add_special": True,
                                               "parse_special": True}))["tokens"]

    def images_refused(self) -> str | None:
        return "specgate serves images on MLX engines only, not through llama-server"

    async def prepare_images(self, tokens: list[int], images: list[bytes]):
        raise ValueError(self.images_refused())

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        if not self._has_chat_template:  # chat.py answers 400 chat_template_missing
            raise ValueError(f"model '{self.model_id}' has no chat template")
        # llama-server renders with the GGUF's Jinja template (--jinja is its
        # default), tools and template variables included.
        body: dict = {"messages": messages}
        if tools:
            body["tools"] = tools
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        prompt = (await self._post("/apply-template", body))["prompt"]
        # The template already wrote the special tokens (BOS included, if any).
        return (await self._post("/tokenize", {"content": prompt, "add_special": False,
                                               "parse_special": True}))["tokens"]

    async def message_boundaries(self, messages, tools, tokens, template_kwargs=None
                                 ) -> MessageBoundaries:  # fmt: skip
        return MessageBoundaries()  # llama-server keeps its own prompt cache

    async def thinking_format(self) -> ThinkingFormat | None:
        """The markers mlx-lm would find in the model's tokenizer, read from
        its template (there is no Hugging Face tokenizer here), tokenized by
        llama-server. llama-server holds a grammar over the whole output, so
        a request with one is rendered with thinking off
        (`grammar_after_thinking`); its own budget sampler holds the budget
        (adapter.completion_body)."""
        if self._thinking is not None:
            return self._thinking[0]
        template = await self.chat_template()
        form = None
        if (markers := thinking_markers(template)) is not None:
            tokens = []
            for marker in markers:
                tokens.append(tuple((await self._post("/tokenize", {
                    "content": marker, "add_special": False, "parse_special": True}))["tokens"]))
            form = ThinkingFormat(*markers, tokens[0], tokens[1],
                                  switchable="enable_thinking" in template,
                                  grammar_after_thinking=False)  # fmt: skip
        if template is not None:  # (None: the server did not answer; ask again next time)
            self._thinking = (form,)
        return form

    async def check_constraint(self, constraint: OutputConstraint) -> None:
        # The grammar alone (no in-process tokenizer here): llama-server
        # compiles the schema itself, bounds.py keeps what reaches it shallow.
        await SANDBOX.check(constraint.grammar, constraint.param, None)

    async def chat_template(self) -> str | None:
        if not self._has_chat_template:  # /props would show llama-server's chatml fallback
            return None
        r = await self._ask("GET", "/props")
        if r.status_code != 200:
            return None
        template = r.json().get("chat_template")
        return template if isinstance(template, str) and template else None

    # -- generation ----------------------------------------------------------------

    def refusal(self, sampling: SamplingParams) -> Refusal | None:
        return refusal(sampling, self.speculative)

    def generate(
        self, request: GenerationRequest, planner: Planner | None = None
    ) -> AsyncIterator[TokenEvent | RoundStats]:
        """Admit at once (or raise EngineOverloaded); the stream starts when iterated."""
        # llama-server queues what its slots cannot take; bound that queue here.
        if self._in_flight >= self._max_in_flight:
            raise EngineOverloaded(
                f"model '{self.model_id}' is at capacity ({self._in_flight} requests in flight)"
            )
        return self._stopped_or(self._stream(request))

    async def _stopped_or(self, stream: AsyncIterator) -> AsyncIterator:
        """The stream, whose failure while the engine stops is EngineStopped
        (the gateway's 503 'shutting down'), not a failed llama-server."""
        try:
            async with aclosing(stream):
                async for item in stream:
                    yield item
        except EngineError as e:
            if self._stopping and not isinstance(e, EngineStopped):
                raise EngineStopped(f"model '{self.model_id}' ({self.name}) was stopped") from e
            raise

    async def _stream(
        self, request: GenerationRequest
    ) -> AsyncIterator[TokenEvent | RoundStats | PrefillProgress]:
        assert self._client is not None, "engine not started"
        finished = False
        process = self.server.starts  # which process serves this request (set again below)
        self._in_flight += 1
        try:
            constraint = request.sampling.constraint
            prefix, suffix = (constraint.prefix, constraint.suffix) if constraint else ("", "")
            async with self.server.use() as url:
                process = self.server.starts
                # The fixed text before the schema's value is prompt to
                # llama-server, and text of the output to the client.
                prefix_tokens = await self._tokenized(prefix) if prefix else []
                req = self._client.build_request("POST", url + "/completion",
                                                 json=completion_body(request, prefix_tokens,
                                                                      self._reproducible))
                # llama-server sends the headers once a slot takes the request.
                resp = await self._progress(self._client.send(req, stream=True))
                try:
                    if resp.status_code != 200:
                        raise EngineError(f"llama-server answered {resp.status_code}: "
                                          f"{_error_message((await resp.aread()).decode())}")
                    lines = resp.aiter_lines()
                    while (chunk := await self._progress(_next_event(lines))) is not None:
                        if "error" in chunk:
                            raise EngineError(f"llama-server: {_error_message(chunk)}")
                        if "prompt_progress" in chunk:
                            if (progress := read_progress(chunk)) is not None:
                                yield progress
                            continue
                        got = read_chunk(chunk, request)
                        finished = got.finish_reason is not None
                        text = prefix + got.text + (suffix if got.finish_reason == "stop" else "")
                        prefix = ""
                        if got.token_ids or text or finished:
                            yield TokenEvent(got.token_ids, text, got.finish_reason,
                                             got.logprobs, got.cached_tokens)
                        if finished:
                            break
                finally:
                    await resp.aclose()
                if not finished:
                    raise EngineError(await self._why_cut_short("the stream ended early", process))
                if self.speculative:
                    for stats in await self._rounds_since_last():
                        yield stats
        except (httpx.TransportError, json.JSONDecodeError) as e:
            raise EngineError(await self._why_cut_short(f"{type(e).__name__}: {e}", process)) from e
        except LlamaServerError as e:
            raise EngineError(str(e)) from e
        finally:
            self._in_flight -= 1

    async def _tokenized(self, text: str) -> list[int]:
        try:
            return (await self._post("/tokenize", {"content": text, "add_special": False,
                                                   "parse_special": True}))["tokens"]  # fmt: skip
        except ValueError as e:
            raise EngineError(f"llama-server could not tokenize {text!r}: {e}") from None

    async def _progress(self, step: Awaitable[T]) -> T:
        """The next step of a request, or EngineError if llama-server takes
        longer than progress_timeout to make it."""
        try:
            async with asyncio.timeout(self.progress_timeout):
                return await step
        except TimeoutError:
            msg = (f"llama-server for model '{self.model_id}' made no progress for "
                   f"{self.progress_timeout:g} s (no token, no prompt progress)")
            if self.server.problem:
                msg += f"; {self.server.problem}"
            raise EngineError(msg) from None

    async def _why_cut_short(self, what: str, process: int) -> str:
        msg = f"llama-server for {self.model_id} failed mid-request ({what})"

        def gone() -> bool:  # the process that served this request, that is
            return self.server.starts != process or not self.server.alive

        # A dead server's sockets close a moment before its exit can be reaped.
        for _ in range(20):
            if gone():
                break
            await asyncio.sleep(0.05)
        if gone():
            msg += f"; {self.server.death or 'the process exited'}, and it will be restarted"
        return msg

    async def _read_counters(self) -> SpecCounters:
        assert self._client is not None
        r = await self._client.get(self.server.base_url + "/metrics", timeout=QUICK_TIMEOUT_S)
        r.raise_for_status()
        return parse_spec_counters(r.text)

    async def _rounds_since_last(self) -> list[RoundStats]:
        """The speculation the server did since the last read, as rounds.

        The counters are server-wide, so with several requests in flight a
        request may carry another's rounds; every round is still counted
        exactly once, which is what the metrics need.
        """
        async with self._counters_lock:
            try:
                now = await self._read_counters()
            except httpx.HTTPError as e:
                log.warning("llama-server /metrics unreadable for %s: %s", self.model_id, e)
                return []
            # A restarted server counts from zero again.
            before = self._counters if self._counters_start == self.server.starts else SpecCounters()
            delta, self._counters, self._counters_start = now.minus(before), now, self.server.starts
        return rounds_from_counters(self.model_id, self.method, delta)


def _kind(server: LlamaServer) -> str:
    return f"the {server.spec.spec['type'] if server.spec.spec else 'plain'} process"


async def _next_event(lines: AsyncIterator[str]) -> dict | None:
    """The next `data:` event of an SSE stream (None at its end), skipping the
    blank separators and the `:` comments (llama-server's pings)."""
    async for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    return None


def _error_message(payload: str | dict) -> str:
    """The message out of llama-server's error body ({"error": {"message": ...}})."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError:
            return payload.strip()[:500]
    err = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)
