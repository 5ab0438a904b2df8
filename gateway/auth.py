"""API keys: the keys file, checking a presented key, and the ASGI middleware.

A key reads `sg-<id>.<secret>`. The id is a short non-secret handle, so the
server finds a key's record without hashing against every record; the
secret is 256 random bits and the file keeps only its SHA-256. A slow,
salted KDF exists to protect low-entropy passwords from guessing; against
a 256-bit random secret one hash is already out of reach, and a slow one
only hands every client that sends a wrong key ~100 ms of server CPU.
Files written before keep their PBKDF2 records (`scheme: pbkdf2_sha256`),
which still work; see KeyStore for how they are kept cheap.
The plaintext is printed once by `specgate keys add` and never stored or
logged. The file (JSON, $SPECGATE_HOME/keys unless `auth.keys_file` says
otherwise) is replaced atomically and readable by its owner only. Every
record is validated when the file is read, so a bad one stops
`specgate serve` (or an /admin/reload, which keeps the old keys) with the
file, the record and the field, instead of failing its key's requests.

Wrong keys are limited per client address (FailedAuthLimiter): past
`auth.failed_auth_limit` within the window an address gets 429 for wrong
keys and for any key whose check would be slow.

With no keys in the file the server is open, as one anonymous key, but only
on a loopback bind: `specgate serve` refuses a LAN address without keys,
and a server whose last key is revoked while on the LAN refuses everyone.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import tempfile
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.checkpoints.default_model import specgate_home
from gateway.config import AuthConfig
from gateway.errors import error_response
from gateway.quotas import KeyLimits, KeyUsage

log = logging.getLogger(__name__)

KEY_PREFIX = "sg-"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
KEY_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # no ".": it ends the id in a key
SHA256 = "sha256"
PBKDF2 = "pbkdf2_sha256"  # files from before SHA-256; read and verified, never written new
PBKDF2_ITERATIONS = 100_000  # what those files used (a record without `iterations`)
# A typo'd iteration count must not turn one key check into minutes of CPU.
MAX_PBKDF2_ITERATIONS = 10_000_000
FILE_VERSION = 2  # 2: records carry `scheme`; 1 (no scheme): every record is PBKDF2
ANONYMOUS = "anonymous"


class KeyFileError(Exception):
    """The keys file cannot be read or used; the message says which and why."""


def default_keys_file() -> Path:
    return specgate_home() / "keys"


def is_loopback(host: str) -> bool:
    """Only addresses that cannot be reached from another machine count."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


# -- the keys file --------------------------------------------------------------------------


def _sha256(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _pbkdf2(secret: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)


def _hex_bytes(value: str, what: str, length: int | None = None) -> str:
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"must be {what} in hex digits") from None
    if not raw or (length is not None and len(raw) != length):
        size = f"{length} bytes ({2 * length} hex digits)" if length else "at least 1 byte"
        raise ValueError(f"must be {what} of {size}")
    return value


class KeyRecord(BaseModel):
    """One key in the file. Strict: a value of the wrong type is an error
    here, at load, not a 500 when the key is first used."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str
    key_id: str
    # Absent in files from before SHA-256: those records are all PBKDF2.
    scheme: Literal["sha256", "pbkdf2_sha256"] = PBKDF2
    hash: str  # hex: SHA-256 of the secret, or its PBKDF2-HMAC-SHA256
    salt: str | None = None  # hex; PBKDF2 only
    iterations: int | None = Field(None, ge=1, le=MAX_PBKDF2_ITERATIONS)  # PBKDF2 only
    models: list[str] | None = None  # None: every model
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    admin: bool = False
    created: str = ""  # ISO 8601, UTC

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_PATTERN.match(v):
            raise ValueError("use 1-64 of A-Z a-z 0-9 . _ -")
        return v

    @field_validator("key_id")
    @classmethod
    def _key_id(cls, v: str) -> str:
        if not KEY_ID_PATTERN.match(v):
            raise ValueError("use 1-64 of A-Z a-z 0-9 _ -")
        return v

    @field_validator("hash")
    @classmethod
    def _hash(cls, v: str) -> str:
        return _hex_bytes(v, "a SHA-256 digest", 32)

    @field_validator("salt")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        return None if v is None else _hex_bytes(v, "a salt")

    @model_validator(mode="before")
    @classmethod
    def _pbkdf2_default_iterations(cls, data):
        # The old format's default, for a record written without the field.
        if isinstance(data, dict) and data.get("scheme", PBKDF2) == PBKDF2:
            data = {"iterations": PBKDF2_ITERATIONS} | data
        return data

    @model_validator(mode="after")
    def _fields_of_the_scheme(self) -> KeyRecord:
        if self.scheme == PBKDF2 and self.salt is None:
            raise ValueError("salt: missing (a pbkdf2_sha256 record needs one)")
        if self.scheme == SHA256:
            extra = [f for f in ("salt", "iterations") if getattr(self, f) is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)}: not used by scheme sha256; remove it")
        return self

    @property
    def limits(self) -> KeyLimits:
        return KeyLimits(self.rpm, self.tpm, self.max_concurrent)

    @property
    def slow(self) -> bool:
        """Checking a secret against this record runs the KDF (~100 ms of CPU)."""
        return self.scheme == PBKDF2

    def matches(self, secret: str) -> bool:
        """Constant-time. For a PBKDF2 record this is the slow KDF: call it off
        the event loop."""
        if self.scheme == SHA256:
            digest = _sha256(secret)
        else:
            digest = _pbkdf2(secret, bytes.fromhex(self.salt), self.iterations)
        return hmac.compare_digest(digest, bytes.fromhex(self.hash))


def split_key(presented: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed key, else None."""
    if not presented.startswith(KEY_PREFIX):
        return None
    key_id, dot, secret = presented[len(KEY_PREFIX):].partition(".")
    if not dot or not key_id or not secret:
        return None
    return key_id, secret


def _record_errors(err: ValidationError) -> str:
    """pydantic's errors for one record, on one line: field, problem, value."""
    parts = []
    for e in err.errors():
        field_ = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        got = ""
        if e["type"] != "missing" and field_:
            shown = json.dumps(e["input"], default=str)
            got = f" (got {shown[:60]}{'...' if len(shown) > 60 else ''})"
        parts.append(f"{field_}: {msg}{got}" if field_ else msg)
    return "; ".join(parts)


def parse_keys(data: object, source: str) -> list[KeyRecord]:
    """The records of a keys file's JSON, every one validated; KeyFileError
    names the file, the record (name and position) and the field."""
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise KeyFileError(f"{source}: not a specgate keys file (expected an object with a "
                           "'keys' list)")
    version = data.get("version", 1)
    if version not in (1, FILE_VERSION):
        raise KeyFileError(f"{source}: version {version!r}: this specgate reads versions 1 and "
                           f"{FILE_VERSION}")
    records: list[KeyRecord] = []
    problems: list[str] = []
    seen_ids: dict[str, int] = {}
    seen_names: dict[str, int] = {}
    for i, entry in enumerate(data["keys"]):
        name = entry.get("name") if isinstance(entry, dict) else None
        where = f"key {name!r} (keys[{i}])" if isinstance(name, str) else f"keys[{i}]"
        try:
            record = KeyRecord.model_validate(entry)
        except ValidationError as e:
            problems.append(f"{where}: {_record_errors(e)}")
            continue
        if record.key_id in seen_ids:
            problems.append(f"{where}: key_id: {record.key_id!r} is also keys[{seen_ids[record.key_id]}]'s")
        elif record.name in seen_names:
            problems.append(f"{where}: name: {record.name!r} is also keys[{seen_names[record.name]}]'s")
        seen_ids.setdefault(record.key_id, i)
        seen_names.setdefault(record.name, i)
        records.append(record)
    if problems:
        raise KeyFileError(f"{source}: " + "; ".join(problems))
    return records


def read_keys(path: Path) -> list[KeyRecord]:
    """The records in the keys file, all valid; no file means no keys."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{path}: cannot read the keys file: "
                           f"{getattr(e, 'strerror', None) or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise KeyFileError(f"{path}: not a specgate keys file ({e})") from None
    return parse_keys(data, str(path))


def write_keys(path: Path, records: list[KeyRecord]) -> None:
    """Replace the file atomically (a reader sees the old or the new one),
    created 0600 so no other user ever sees the hashes. PBKDF2 records are
    written back as they are: turning one into SHA-256 needs its secret,
    which the file does not have (re-create the key to move it)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = json.dumps(
        {"version": FILE_VERSION, "keys": [r.model_dump(exclude_none=True) for r in records]},
        indent=2,
    ) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".keys-", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_key(
    path: Path,
    name: str,
    *,
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrent: int | None = None,
    admin: bool = False,
) -> str:
    """Store a new key's hash and return the key itself (its only copy)."""
    if not NAME_PATTERN.match(name):
        raise KeyFileError(f"key name {name!r}: use 1-64 of A-Z a-z 0-9 . _ -")
    for label, value in (("rpm", rpm), ("tpm", tpm), ("max-concurrent", max_concurrent)):
        if value is not None and value < 1:
            raise KeyFileError(f"--{label}: must be at least 1 (got {value})")
    records = read_keys(path)
    if any(r.name == name for r in records):
        raise KeyFileError(f"a key named {name!r} exists; revoke it first or pick another name")
    taken = {r.key_id for r in records}
    while (key_id := secrets.token_hex(4)) in taken:
        pass
    secret = secrets.token_urlsafe(32)
    record = KeyRecord(
        name=name, key_id=key_id, scheme=SHA256, hash=_sha256(secret).hex(), models=models,
        rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, admin=admin,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    write_keys(path, records + [record])
    return f"{KEY_PREFIX}{key_id}.{secret}"


def revoke_key(path: Path, name: str) -> bool:
    records = read_keys(path)
    kept = [r for r in records if r.name != name]
    if len(kept) == len(records):
        return False
    write_keys(path, kept)
    return True


# -- who is asking ---------------------------------------------------------------------------


@dataclass
class Principal:
    """The key a request came with (or the anonymous one of an open server)."""

    name: str
    models: frozenset[str] | None = None  # None: every model
    admin: bool = False
    usage: KeyUsage = field(default_factory=KeyUsage)

    def may_use(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models


# Set by AuthMiddleware for the request being served; the routes and
# gateway/generation.py read it. Outside a request (or with no middleware):
# anonymous, no limits.
_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "specgate_principal", default=None
)
_UNGUARDED = Principal(ANONYMOUS, admin=True)


def current_principal() -> Principal:
    return _current.get() or _UNGUARDED


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
            self._verified[record.key_id] = _sha256(secret)
        return ok

    def _known(self, key_id: str, secret: str) -> bool | None:
        """A PBKDF2 key's answer from its remembered verification, None if none."""
        known = self._verified.get(key_id)
        return None if known is None else hmac.compare_digest(known, _sha256(secret))


# -- failed authentications per client -------------------------------------------------------


def client_of(scope) -> str:
    """Whom failures are counted against: the peer address; an IPv6 one by
    its /64, the block a single host gets (and rotates privacy addresses in).
    Behind a reverse proxy every client is the proxy: forwarded headers are
    not trusted, since any client can send them."""
    host = (scope.get("client") or ("unknown", 0))[0]
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


class AuthMiddleware:
    """Every /v1 and /admin route needs a valid key once keys exist (and
    /metrics when `metrics_requires_key`); /health and /ready never do.
    Plain ASGI, so streaming responses pass through untouched.

    A client past its failure limit (`limiter`) gets 429 + Retry-After for a
    wrong key, and for a key whose check would run the slow KDF, without
    running it. Its keys that cost one hash (every SHA-256 key, a PBKDF2 key
    verified before) are still checked and a valid one served: the address
    may be a NAT that an attacker shares with honest clients, and checking
    those costs what answering 429 does. A missing key is not counted: it
    costs nothing to refuse and is a client's configuration mistake.
    `on_failure(reason)` is told of each refusal: "missing", "invalid",
    "no_keys", and "rate_limited" for a 429."""

    def __init__(self, app, keys: KeyStore, metrics_requires_key: bool, on_failure=None,
                 limiter: FailedAuthLimiter | None = None):
        self.app = app
        self.keys = keys
        self.metrics_requires_key = metrics_requires_key
        self.on_failure = on_failure or (lambda reason: None)
        # `is None`, not `or`: an empty limiter has len() 0 and is falsy.
        self.limiter = limiter if limiter is not None else FailedAuthLimiter.from_config(AuthConfig())

    def _guarded(self, path: str) -> bool:
        return (
            path == "/v1" or path.startswith(("/v1/", "/admin/"))
            or (path == "/metrics" and self.metrics_requires_key)
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            return await self.app(scope, receive, send)
        if self.keys.empty:
            if not self.keys.open_when_empty:
                return await self._refuse(scope, send, "no_keys", "this server has no API keys "
                                          "configured, so it serves nobody off loopback")
            principal = self.keys.anonymous
        else:
            presented = presented_key(scope["headers"])
            if presented is None:
                return await self._refuse(
                    scope, send, "missing",
                    "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                )
            principal = await self._check(scope, send, presented)
            if principal is None:
                return
        token = _current.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)

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
