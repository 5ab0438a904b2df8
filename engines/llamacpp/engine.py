"""The llamacpp engines: a GGUF model served by a managed llama-server.

Two engines, one per process: `llamacpp` (plain decoding) and `llamacpp_mtp`
(`--spec-type draft-mtp`). llama-server b11312 fixes speculation per process:
its per-request `speculative.*` fields are compiled out (`#if 0` in
tools/server/server-schema.cpp). So a model that lets the policy switch
speculation per request runs both processes; they map the same GGUF file, so
on the CPU the weights are one copy in the page cache and the second process
costs its KV cache and compute buffers.

Tokenization is the server's own (/tokenize, /apply-template): the GGUF's
vocabulary and chat template, whatever model it is. Requests go to
/completion as token ids and stream back chunk by chunk; closing the stream
closes the connection, which makes llama-server drop the request. After each
speculative request the server's `llamacpp:spec_decode_*` counters are read
and their growth becomes RoundStats (see adapter.rounds_from_counters).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx

from engines.base import (
    EngineError,
    EngineOverloaded,
    GenerationRequest,
    LiveState,
    Method,
    Planner,
    Refusal,
    RoundStats,
    SamplingParams,
    TokenEvent,
)
from engines.llamacpp.adapter import (
    SpecCounters,
    completion_body,
    parse_spec_counters,
    read_chunk,
    refusal,
    rounds_from_counters,
)
from engines.llamacpp.process import LlamaServer, LlamaServerError

log = logging.getLogger(__name__)


class LlamaCppEngine:
    def __init__(
        self,
        model_id: str,
        server: LlamaServer,
        *,
        method: Method,
        max_context: int,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_queue: int,
        start_at_boot: bool = True,
        read_timeout: float = 600.0,
    ):
        self.name = "llamacpp_mtp" if method == "llamacpp_mtp" else "llamacpp"
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
        self._client: httpx.AsyncClient | None = None
        self._in_flight = 0
        self._counters = SpecCounters()
        self._counters_start = 0  # which server start self._counters were read from
        self._counters_lock = asyncio.Lock()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def speculative(self) -> bool:
        return self.method == "llamacpp_mtp"

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        self._client = httpx.AsyncClient(trust_env=False, timeout=self._timeout)
        if self._start_at_boot:
            await self.server.start()
            if self.speculative:
                self._counters, self._counters_start = await self._read_counters(), self.server.starts

    async def stop(self) -> None:
        await self.server.stop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def problem(self) -> str | None:
        return None

    def live_state(self) -> LiveState:
        active = min(self._in_flight, self.slots)
        return LiveState(active, self._in_flight - active, 0)

    # -- the server's tokenizer ----------------------------------------------------

    async def _post(self, path: str, body: dict) -> dict:
        assert self._client is not None, "engine not started"
        try:
            async with self.server.use() as url:
                r = await self._client.post(url + path, json=body)
        except (httpx.TransportError, LlamaServerError) as e:
            raise EngineError(f"llama-server for {self.model_id} is not answering: {e}") from e
        if r.status_code != 200:
            raise ValueError(_error_message(r.text))
        return r.json()

    async def encode(self, text: str) -> list[int]:
        return (await self._post("/tokenize", {"content": text, "add_special": True,
                                               "parse_special": True}))["tokens"]

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # llama-server renders with the GGUF's Jinja template (--jinja is its
        # default), tools included.
        body: dict = {"messages": messages}
        if tools:
            body["tools"] = tools
        prompt = (await self._post("/apply-template", body))["prompt"]
        # The template already wrote the special tokens (BOS included, if any).
        return (await self._post("/tokenize", {"content": prompt, "add_special": False,
                                               "parse_special": True}))["tokens"]

    async def chat_template(self) -> str | None:
        assert self._client is not None, "engine not started"
        try:
            async with self.server.use() as url:
                r = await self._client.get(url + "/props")
        except (httpx.TransportError, LlamaServerError) as e:
            raise EngineError(f"llama-server for {self.model_id} is not answering: {e}") from e
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
        return self._stream(request)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | RoundStats]:
        assert self._client is not None, "engine not started"
        finished = False
        self._in_flight += 1
        try:
            async with self.server.use() as url:
                async with self._client.stream(
                    "POST", url + "/completion", json=completion_body(request)
                ) as resp:
                    if resp.status_code != 200:
                        raise EngineError(f"llama-server answered {resp.status_code}: "
                                          f"{_error_message((await resp.aread()).decode())}")
                    lines = resp.aiter_lines()
                    async for line in lines:
                        if not line.startswith("data: "):
                            continue  # blank separators, SSE comments (pings)
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise EngineError(f"llama-server: {_error_message(chunk)}")
                        got = read_chunk(chunk, request)
                        finished = got.finish_reason is not None
                        if got.token_ids or got.text or finished:
                            yield TokenEvent(got.token_ids, got.text, got.finish_reason,
                                             got.logprobs, got.cached_tokens)
                        if finished:
                            break
                if not finished:
                    raise EngineError(await self._why_cut_short("the stream ended early"))
                if self.speculative:
                    for stats in await self._rounds_since_last():
                        yield stats
        except (httpx.TransportError, json.JSONDecodeError) as e:
            raise EngineError(await self._why_cut_short(f"{type(e).__name__}: {e}")) from e
        except LlamaServerError as e:
            raise EngineError(str(e)) from e
        finally:
            self._in_flight -= 1

    async def _why_cut_short(self, what: str) -> str:
        msg = f"llama-server for {self.model_id} failed mid-request ({what})"
        # A dead server's sockets close a moment before its exit can be reaped.
        for _ in range(20):
            if not self.server.alive:
                break
            await asyncio.sleep(0.05)
        if not self.server.alive:
            msg += f"; the process exited (code {self.server.exit_code}) and will be restarted"
        return msg

    async def _read_counters(self) -> SpecCounters:
        assert self._client is not None
        r = await self._client.get(self.server.base_url + "/metrics")
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
        return rounds_from_counters(self.model_id, delta)


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
