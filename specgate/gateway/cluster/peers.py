"""Other specgate nodes this one routes requests to (config `peers:`).

Each peer is checked with `GET /v1/models` under its node key: the answer
says which models it serves and how loaded each is (the `specgate` field
of each entry, api/openai_api.py's `load_fields`). A failed check, or a request that
could not reach it, marks the peer down; a down peer is checked again
after a wait that doubles up to `max_backoff_s`, and is up at its first
good answer. A peer is trusted no more than a client: a check reads at
most `max_models_body` bytes and takes at most `check_timeout_s`.

Which node serves a request is `choose`, a plain function: the least
loaded candidate by (running + waiting) / max_concurrent, this node first
on a tie (no hop), then by name. A peer's load is what it reported at its
last check with the requests sent there since added (and those that ended
taken off), so a burst spreads before the next check sees it.
gateway/cluster/proxy.py carries the request there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx

from specgate.gateway.api.openai_api import load_fields
from specgate.gateway.config import LOCAL_NODE, PeerConfig

log = logging.getLogger(__name__)

# Asked of every peer: its answers' bytes as they are, counted against the
# caps, parsed and relayed as they are (nothing here decompresses them).
IDENTITY = {"Accept-Encoding": "identity"}


@dataclass(frozen=True)
class ModelLoad:
    """One node's load on one model, as its /v1/models reports it."""

    running: int = 0
    waiting: int = 0
    capacity: int = 1  # max_concurrent (requests decoded together)
    state: str = "ready"  # ready | loading | unloaded | unhealthy | failed


SERVING_STATES = ("ready", "loading", "unloaded")  # a request there is served (or loads it)


@dataclass(frozen=True)
class Candidate:
    node: str  # a peer's name, or LOCAL_NODE
    load: float  # (running + waiting) / capacity

    @property
    def local(self) -> bool:
        return self.node == LOCAL_NODE


def choose(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates in the order to try them: least loaded first, this
    node first among equals, then by name (so ties break the same way)."""
    return sorted(candidates, key=lambda c: (c.load, not c.local, c.node))


def fraction(running: int, waiting: int, capacity: int) -> float:
    return (running + waiting) / max(1, capacity)


@dataclass
class PeerNode:
    config: PeerConfig
    up: bool = False
    problem: str | None = "not checked yet"
    models: dict[str, ModelLoad] = field(default_factory=dict)  # from the last good check
    failures: int = 0  # checks failed in a row
    checked_at: float | None = None
    # Requests from here in flight there, by model; and as they stood at the
    # last check, whose reported load counted them already.
    inflight: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _inflight_at_check: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name

    def serves(self, model: str) -> bool:
        load = self.models.get(model)
        return load is not None and load.state in SERVING_STATES

    def load(self, model: str) -> float:
        reported = self.models.get(model, ModelLoad())
        others = max(0, reported.running + reported.waiting - self._inflight_at_check.get(model, 0))
        return (others + self.inflight[model]) / max(1, reported.capacity)

    def headers(self) -> dict[str, str]:
        key = self.config.key
        return {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}

    def mark_down(self, why: str) -> None:
        if self.up:
            log.warning("peer %s is down: %s", self.name, why)
        self.up, self.problem = False, why

    def checked(self, models: dict[str, ModelLoad]) -> None:
        if not self.up:
            log.info("peer %s is up, serving %s", self.name, ", ".join(sorted(models)) or "nothing")
        self.up, self.problem, self.failures = True, None, 0
        self.models, self.checked_at = models, time.monotonic()
        self._inflight_at_check = dict(self.inflight)

    def failed_check(self, why: str) -> None:
        self.failures += 1
        self.mark_down(why)

    def next_check_s(self) -> float:
        interval = self.config.health_interval_s
        if self.up:
            return interval
        return min(self.config.max_backoff_s, interval * 2 ** max(0, self.failures - 1))


def parse_models(body: object) -> dict[str, ModelLoad]:
    """A peer's /v1/models answer -> its models and their load; ValueError
    if it is not a model list."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("its /v1/models answer is not a model list")
    out = {}
    for entry in body["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        extra = entry.get("specgate")
        if not isinstance(extra, dict):  # another server (not specgate): load not known
            out[entry["id"]] = ModelLoad()
            continue
        state = extra.get("state")
        out[entry["id"]] = ModelLoad(_count(extra, "running", 0), _count(extra, "waiting", 0),
                                     max(1, _count(extra, "max_concurrent", 1)),
                                     state if isinstance(state, str) else "ready")  # fmt: skip
    return out


def _count(fields: dict, name: str, default: int) -> int:
    value = fields.get(name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


class Peers:
    """The configured peers, their health checks, and their models."""

    def __init__(self, configs: list[PeerConfig]):
        self.nodes = {c.name: PeerNode(c) for c in configs}
        self.client = httpx.AsyncClient(trust_env=False, timeout=None)
        self._watchers: list[asyncio.Task] = []

    def __bool__(self) -> bool:
        return bool(self.nodes)

    async def start(self) -> None:
        self._watchers = [asyncio.create_task(self._watch(n), name=f"peer-{n.name}")
                          for n in self.nodes.values()]  # fmt: skip

    async def stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._watchers = []
        await self.client.aclose()

    async def _watch(self, node: PeerNode) -> None:
        while True:
            await self.check(node)
            await asyncio.sleep(node.next_check_s())

    async def check(self, node: PeerNode) -> None:
        c = node.config
        try:
            # A peer's /v1/models answers from its event loop, never a model:
            # the whole check has a deadline, not only each read (a peer
            # sending a byte a second would pass every read's).
            async with asyncio.timeout(c.check_timeout_s):
                async with self.client.stream(
                        "GET", c.base_url + "/v1/models", headers=node.headers() | IDENTITY,
                        timeout=httpx.Timeout(c.check_timeout_s, connect=c.connect_timeout_s)) as r:  # fmt: skip
                    if r.status_code in (401, 403):
                        node.failed_check(f"{c.base_url} refused this node's key ({r.status_code}); "
                                          "set the peer's `key` to one of its API keys")  # fmt: skip
                        return
                    if r.status_code != 200:
                        node.failed_check(f"{c.base_url}/v1/models answered {r.status_code}")
                        return
                    raw = await read_capped(r, c.max_models_body)
        except TimeoutError:
            node.failed_check(f"{c.base_url} did not answer /v1/models within "
                              f"{c.check_timeout_s:g} s")  # fmt: skip
            return
        except TooLarge as e:
            node.failed_check(f"{c.base_url} answered a /v1/models body {e}")
            return
        except httpx.HTTPError as e:
            node.failed_check(f"{c.base_url} unreachable: {describe(e)}")
            return
        try:
            node.checked(parse_models(json.loads(raw)))
        except (ValueError, RecursionError):
            node.failed_check(f"{c.base_url}: its /v1/models answer is not a model list")

    def serving(self, model: str) -> list[PeerNode]:
        """The peers whose last good check listed `model` as servable."""
        return [n for n in self.nodes.values() if n.serves(model)]

    def listing(self, local: list[dict], created: int) -> list[dict]:
        """This node's /v1/models entries with the peers' models added: one
        entry per model, its load summed over the nodes serving it. A peer
        down now still lists what it served at its last good check (a
        request then gets a 503 that says so, rather than a model that
        comes and goes from a client's list)."""
        entries = {e["id"]: e for e in local}
        for node in self.nodes.values():
            for model, load in node.models.items():
                entry = entries.setdefault(model, {
                    "id": model, "object": "model", "created": created, "owned_by": "specgate",
                    "specgate": load_fields(0, 0, 0, "down")})  # fmt: skip
                fields = entry["specgate"]
                state = load.state if node.up else "down"
                fields["state"] = min(fields["state"], state, key=_rank)
                if node.up:
                    fields["running"] += load.running
                    fields["waiting"] += load.waiting
                    fields["max_concurrent"] += load.capacity
        return list(entries.values())


# The state a model listed by several nodes shows: the best of theirs.
_STATE_RANK = ("ready", "loading", "unloaded", "unhealthy", "failed", "shutting_down", "down")


def _rank(state: str) -> int:
    return _STATE_RANK.index(state) if state in _STATE_RANK else len(_STATE_RANK)


def peer_status(peers: Peers) -> list[dict]:
    """The peers as /admin/status shows them."""
    return [{"name": n.name, "url": n.config.base_url, "up": n.up, "problem": n.problem,
             "models": {m: load_fields(x.running, x.waiting, x.capacity, x.state)
                        for m, x in n.models.items()},
             "in_flight": sum(n.inflight.values())} for n in peers.nodes.values()]  # fmt: skip


class TooLarge(Exception):
    """A peer sent more than this node reads of one answer (or one event)."""

    def __init__(self, limit: int):
        super().__init__(f"over {size_words(limit)}")


async def read_capped(response: httpx.Response, limit: int) -> bytes:
    """A peer's whole body as sent, but never more than `limit` bytes of it
    held: past that, TooLarge (the caller closes the response)."""
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise TooLarge(limit)
    return bytes(body)


def size_words(n: int) -> str:
    """1048576 -> "1 MiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def describe(error: BaseException) -> str:
    """An httpx error in a few words ("ConnectError: [Errno 111] Connection refused")."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
