"""API keys at the door: who a request is, wrong keys limited, the ASGI middleware.

The keys themselves (records, the file) are gateway/access/keys.py. Wrong keys are
limited per client address (FailedAuthLimiter): past
`auth.failed_auth_limit` within the window an address gets 429 for wrong
keys and for any key whose check would be slow.

With no keys in the file the server is open, as one anonymous key, but only
on a loopback bind: `specgate serve` refuses a LAN address without keys,
and a server whose last key is revoked while on the LAN refuses everyone.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import ipaddress
import logging
import math
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from specgate.gateway.access.keys import KeyRecord, read_keys, sha256_of, split_key
from specgate.gateway.access.quotas import KeyUsage
from specgate.gateway.config import AuthConfig
from specgate.gateway.errors import error_response

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"


def is_loopback(host: str) -> bool:
    """Only addresses that cannot be reached from another machine count."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


# -- who is asking ---------------------------------------------------------------------------


@dataclass
class Principal:
    """The key a request came with (or the anonymous one of an open server)."""

    name: str
    models: frozenset[str] | None = None  # None: every model
    admin: bool = False
    usage: KeyUsage = field(default_factory=KeyUsage)
    # A loopback client without a key, let in to read the admin page's
    # status only (AuthMiddleware.read_only_paths): no model, no action.
    viewer: bool = False

    def may_use(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models


# Set by AuthMiddleware for the request being served; the routes and
# gateway/serving/generation.py read it. Outside a request (or with no middleware):
# anonymous, no limits.
_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "specgate_principal", default=None
)
_UNGUARDED = Principal(ANONYMOUS, admin=True)
LOOPBACK_VIEWER = Principal("loopback", models=frozenset(), viewer=True)


def current_principal() -> Principal:
    return _current.get() or _UNGUARDED


def authenticated() -> Principal | None:
    """The key the key check let this request in with; None on a route it
    does not guard, or before it (the access log: a refused key is none)."""
    return _current.get()


class KeyStore:
    """The keys the server accepts, from the keys file; reload() re-reads it.
    Usage (quota windows, streams in flight) is kept per key name across
    reloads.

    PBKDF2 records (old files) cannot be re-hashed to SHA-256: that needs
    the secret, which only a client presenting the key has, and having the
    server rewrite the keys file on a request would race `specgate keys`
    editing it. So they stay, and are kept cheap: a secret that passed the
    KDF is remembered (its SHA-256), after which that key costs one hash,
    and a wrong secret for it too (a record has one secret: anything else
    is wrong). The KDF runs only for a key id not verified yet in this
    process, off the event loop, one at a time, and the middleware stops
    running it for an address past its failure limit."""

    def __init__(self, path: Path, *, open_when_empty: bool):
        self.path = path
        self.open_when_empty = open_when_empty
        self._by_id: dict[str, KeyRecord] = {}
        self._usage: dict[str, KeyUsage] = {}
        # key id -> SHA-256 of the secret that passed the KDF (PBKDF2 records).
        self._verified: dict[str, bytes] = {}
        # One KDF at a time, in its own thread: however many clients send
        # unverified PBKDF2 keys, they share one core, never the event loop.
        # (A pool rather than a semaphore around to_thread: a request that is
        # cancelled mid-KDF would release a semaphore with its thread still
        # hashing; a queued job of a cancelled request is dropped unrun.)
        self._kdf = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specgate-kdf")
        self.anonymous = Principal(ANONYMOUS, admin=True, usage=KeyUsage())
        self.reload()

    def reload(self) -> int:
        """Re-read the file (KeyFileError keeps the old keys); how many keys."""
        records = read_keys(self.path)
        old = self._by_id
        self._by_id = {r.key_id: r for r in records}
        # A verification stays good for a record that did not change.
        self._verified = {
            kid: digest for kid, digest in self._verified.items()
            if self._by_id.get(kid) == old.get(kid)
        }
        for r in records:
            if r.name in self._usage:
                self._usage[r.name].set_limits(r.limits)
            else:
                self._usage[r.name] = KeyUsage(r.limits)
        legacy = [r.name for r in records if r.slow]
        if legacy:
            log.info("%d API keys in %s use the old PBKDF2 scheme (%s); they keep working. "
                     "Re-create them (specgate keys revoke / add) to store them as SHA-256",
                     len(legacy), self.path, ", ".join(legacy))
        return len(records)

    @property
    def empty(self) -> bool:
        return not self._by_id

    @property
    def names(self) -> list[str]:
        return [r.name for r in self._by_id.values()]

    def listing(self) -> list[tuple[KeyRecord, KeyUsage]]:
        """Every key's record (hashes and ids are the caller's to leave out)
        and its live usage."""
        return [(r, self._usage[r.name]) for r in self._by_id.values()]

    def _principal(self, record: KeyRecord) -> Principal:
        models = None if record.models is None else frozenset(record.models)
        return Principal(record.name, models, record.admin, self._usage[record.name])

    def needs_kdf(self, presented: str) -> bool:
        """Whether checking this key would run the slow KDF: a PBKDF2 record's
        id that no secret has passed yet. Everything else is one hash."""
        parts = split_key(presented)
        record = self._by_id.get(parts[0]) if parts else None
        return record is not None and record.slow and parts[0] not in self._verified

    async def authenticate(self, presented: str | None) -> Principal | None:
        """The key's principal, or None for a missing, malformed or unknown key."""
        parts = split_key(presented) if presented else None
        record = self._by_id.get(parts[0]) if parts else None
        if record is None:
            return None
        key_id, secret = parts
        if not record.slow:
            ok = record.matches(secret)
        elif (ok := self._known(key_id, secret)) is None:
            ok = await asyncio.get_running_loop().run_in_executor(
                self._kdf, self._slow_check, record, secret)
        return self._principal(record) if ok else None

    def _slow_check(self, record: KeyRecord, secret: str) -> bool:
        """In the KDF thread. Another request may have verified the key while
        this one waited its turn."""
        if (ok := self._known(record.key_id, secret)) is not None:
            return ok
        ok = record.matches(secret)
        if ok and self._by_id.get(record.key_id) is record:  # not reloaded meanwhile
            self._verified[record.key_id] = sha256_of(secret)
        return ok

    def _known(self, key_id: str, secret: str) -> bool | None:
        """A PBKDF2 key's answer from its remembered verification, None if none."""
        known = self._verified.get(key_id)
        return None if known is None else hmac.compare_digest(known, sha256_of(secret))


# -- failed authentications per client -------------------------------------------------------


def client_of(scope) -> str:
    """Whom failures are counted against: the peer address, as
    `client_address` names it. Behind a reverse proxy every client is the
    proxy: forwarded headers are not trusted, since any client can send them."""
    return client_address((scope.get("client") or ("unknown", 0))[0])


def client_address(host: str) -> str:
    """One client, by its address: an IPv6 one by its /64, the block a single
    host gets (and rotates privacy addresses in); an IPv4-mapped one as IPv4."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class FailedAuthLimiter:
    """Wrong keys per client in a sliding window: past `limit` of them in
    `window_s` the client is limited until the oldest leaves the window.

    The table is bounded: at most `max_clients` clients are tracked; a
    client seen while it is full of live entries is counted in one shared
    overflow entry, so many addresses can neither grow the memory nor each
    get a fresh allowance by pushing the others out."""

    OVERFLOW = "(others)"

    def __init__(self, limit: int, window_s: float, max_clients: int, clock=time.monotonic):
        self.limit = limit
        self.window_s = window_s
        self.max_clients = max_clients
        self.clock = clock
        # client -> times of its last `limit` failures; least recently failed first.
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    @classmethod
    def from_config(cls, auth: AuthConfig) -> FailedAuthLimiter:
        return cls(auth.failed_auth_limit, auth.failed_auth_window_s, auth.failed_auth_max_clients)

    def __len__(self) -> int:
        return len(self._failures)

    def _entry(self, client: str, now: float) -> str:
        if client in self._failures:
            return client
        # Forget clients whose last failure left the window (oldest first).
        while self._failures:
            first, times = next(iter(self._failures.items()))
            if times and times[-1] > now - self.window_s:  # empty: all forgiven
                break
            del self._failures[first]
        return client if len(self._failures) < self.max_clients else self.OVERFLOW

    def retry_after(self, client: str) -> int | None:
        """Seconds until `client` may fail again, None while it is not limited."""
        now = self.clock()
        times = self._failures.get(self._entry(client, now))
        if times is None or len(times) < self.limit or times[0] <= now - self.window_s:
            return None
        return max(1, math.ceil(times[0] + self.window_s - now))

    def failed(self, client: str) -> float:
        """Count a failure; returns its time, for forgive()."""
        now = self.clock()
        entry = self._entry(client, now)
        times = self._failures.setdefault(entry, deque(maxlen=self.limit))
        times.append(now)
        self._failures.move_to_end(entry)
        if len(times) == self.limit and times[0] > now - self.window_s:
            log.warning("%d wrong API keys from %s within %.0f s: its wrong keys get 429 until "
                        "fewer are in the window", self.limit, entry, self.window_s)
        return now

    def forgive(self, client: str, at: float) -> None:
        """Take back a failure counted ahead of a check that then passed."""
        times = self._failures.get(client) or self._failures.get(self.OVERFLOW)
        if times is not None and at in times:
            times.remove(at)


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key from `Authorization: Bearer` (OpenAI clients) or `x-api-key`
    (Anthropic clients)."""
    bearer = api_key = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, rest = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                bearer = rest.strip()
        elif name == b"x-api-key":
            api_key = value.decode("latin-1").strip()
    return bearer or api_key


def _cross_site_admin_action(scope) -> bool:
    """A browser's POST to /admin/* from a page of another origin. On an open
    loopback server every local caller is an admin, and a web page open in a
    team member's browser could otherwise unload models or reload the config
    with a form post (a "simple" request: no CORS preflight stops it). Browsers
    send Origin on such posts; the CLI and SDKs send none."""
    if scope["method"] in ("GET", "HEAD", "OPTIONS") or not scope["path"].startswith("/admin/"):
        return False
    headers = dict(scope["headers"])
    origin, host = headers.get(b"origin"), headers.get(b"host")
    if origin is None:
        return False
    return origin.split(b"://", 1)[-1].rstrip(b"/").lower() != (host or b"").lower()


class AuthMiddleware:
    """Every /v1, /api (Ollama's) and /admin route needs a valid key once
    keys exist (and /metrics when `metrics_requires_key`); /health and
    /ready never do.
    Plain ASGI, so streaming responses pass through untouched.

    A client past its failure limit (`limiter`) gets 429 + Retry-After for a
    wrong key, and for a key whose check would run the slow KDF, without
    running it. Its keys that cost one hash (every SHA-256 key, a PBKDF2 key
    verified before) are still checked and a valid one served: the address
    may be a NAT that an attacker shares with honest clients, and checking
    those costs what answering 429 does. A missing key is not counted: it
    costs nothing to refuse and is a client's configuration mistake.
    `on_failure(reason)` is told of each refusal: "missing", "invalid",
    "no_keys", and "rate_limited" for a 429.

    A GET of one of `read_only_paths` (the admin page's status) from a
    loopback client that sends no key is let in as LOOPBACK_VIEWER, even
    with keys: someone at the machine sees what it serves; its routes
    leave out keys and log lines. Nothing else is open to it."""

    def __init__(self, app, keys: KeyStore, metrics_requires_key: bool, on_failure=None,
                 limiter: FailedAuthLimiter | None = None,
                 read_only_paths: frozenset[str] = frozenset()):  # fmt: skip
        self.app = app
        self.keys = keys
        self.metrics_requires_key = metrics_requires_key
        self.read_only_paths = read_only_paths
        self.on_failure = on_failure or (lambda reason: None)
        # `is None`, not `or`: an empty limiter has len() 0 and is falsy.
        self.limiter = limiter if limiter is not None else FailedAuthLimiter.from_config(AuthConfig())

    def _guarded(self, path: str) -> bool:
        return (
            path == "/v1" or path.startswith(("/v1/", "/api/", "/admin/"))
            or (path == "/metrics" and self.metrics_requires_key)
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            return await self.app(scope, receive, send)
        if _cross_site_admin_action(scope):
            response = error_response(scope["path"], 403, "an admin action from another site's "
                                      "page is refused (its Origin is not this server)",
                                      code="cross_site")  # fmt: skip
            return await response(scope, None, send)
        if self.keys.empty:
            if not self.keys.open_when_empty:
                return await self._refuse(scope, send, "no_keys", "this server has no API keys "
                                          "configured, so it serves nobody off loopback")
            principal = self.keys.anonymous
        else:
            presented = presented_key(scope["headers"])
            if presented is None and self._viewer(scope):
                principal = LOOPBACK_VIEWER
            elif presented is None:
                return await self._refuse(
                    scope, send, "missing",
                    "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                )
            else:
                principal = await self._check(scope, send, presented)
                if principal is None:
                    return
        token = _current.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)

    def _viewer(self, scope) -> bool:
        if scope["method"] != "GET" or scope["path"] not in self.read_only_paths:
            return False
        try:
            address = ipaddress.ip_address((scope.get("client") or ("", 0))[0])
        except ValueError:  # no client address (a Unix socket): not known to be local
            return False
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback

    async def _check(self, scope, send, presented: str) -> Principal | None:
        """The key's principal, or None once a refusal has been sent."""
        client = client_of(scope)
        wait = self.limiter.retry_after(client)
        slow = self.keys.needs_kdf(presented)
        if wait is not None and slow:
            await self._limited(scope, send, wait)
            return None
        # A slow check is counted as a failure before it runs and forgiven if
        # it passes: otherwise a burst of concurrent wrong keys would all be
        # checked before the first of them counted.
        counted = self.limiter.failed(client) if slow else None
        principal = await self.keys.authenticate(presented)
        if principal is not None:
            if counted is not None:
                self.limiter.forgive(client, counted)
            return principal
        if wait is not None:
            await self._limited(scope, send, wait)
            return None
        if counted is None:
            self.limiter.failed(client)
        await self._refuse(scope, send, "invalid", "invalid API key")
        return None

    async def _refuse(self, scope, send, reason: str, message: str) -> None:
        self.on_failure(reason)
        response = error_response(
            scope["path"], 401, message, code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, None, send)

    async def _limited(self, scope, send, retry_after: int) -> None:
        self.on_failure("rate_limited")
        response = error_response(
            scope["path"], 429,
            f"too many wrong API keys from this address; try again in {retry_after} s",
            code="auth_rate_limited", headers={"Retry-After": str(retry_after)},
        )
        await response(scope, None, send)
