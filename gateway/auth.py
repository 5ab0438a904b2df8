"""API keys: the keys file, checking a presented key, and the ASGI middleware.

A key reads `sg-<id>.<secret>`. The id is a short non-secret handle, so the
server finds a key's record without hashing against every record; the
secret is random (256 bits) and the file keeps only its salted PBKDF2 hash.
The plaintext is printed once by `specgate keys add` and never stored or
logged. The file (JSON, $SPECGATE_HOME/keys unless `auth.keys_file` says
otherwise) is replaced atomically and readable by its owner only.

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
import os
import re
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from engines.checkpoints.default_model import specgate_home
from gateway.errors import error_response
from gateway.quotas import KeyLimits, KeyUsage

log = logging.getLogger(__name__)

KEY_PREFIX = "sg-"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# The secret is 256 random bits: nobody brute-forces that, so the KDF only
# has to make a stolen file useless, and it runs once per key per process.
PBKDF2_ITERATIONS = 100_000
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


@dataclass(frozen=True)
class KeyRecord:
    name: str
    key_id: str
    salt: str  # hex
    hash: str  # hex, PBKDF2-HMAC-SHA256 of the secret
    iterations: int = PBKDF2_ITERATIONS
    models: list[str] | None = None  # None: every model
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    admin: bool = False
    created: str = ""  # ISO 8601, UTC

    @property
    def limits(self) -> KeyLimits:
        return KeyLimits(self.rpm, self.tpm, self.max_concurrent)

    def matches(self, secret: str) -> bool:
        digest = _hash(secret, bytes.fromhex(self.salt), self.iterations)
        return hmac.compare_digest(digest, bytes.fromhex(self.hash))


def _hash(secret: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)


def split_key(presented: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed key, else None."""
    if not presented.startswith(KEY_PREFIX):
        return None
    key_id, dot, secret = presented[len(KEY_PREFIX):].partition(".")
    if not dot or not key_id or not secret:
        return None
    return key_id, secret


def read_keys(path: Path) -> list[KeyRecord]:
    """The records in the keys file; no file means no keys."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the keys file: {e.strerror or e}") from None
    try:
        data = json.loads(text)
        records = [KeyRecord(**entry) for entry in data["keys"]]
    except (ValueError, KeyError, TypeError) as e:
        raise KeyFileError(f"{path}: not a specgate keys file ({e})") from None
    return records


def write_keys(path: Path, records: list[KeyRecord]) -> None:
    """Replace the file atomically (a reader sees the old or the new one),
    created 0600 so no other user ever sees the hashes."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = json.dumps({"version": 1, "keys": [asdict(r) for r in records]}, indent=2) + "\n"
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
    salt = secrets.token_bytes(16)
    record = KeyRecord(
        name=name, key_id=key_id, salt=salt.hex(),
        hash=_hash(secret, salt, PBKDF2_ITERATIONS).hex(), models=models, rpm=rpm, tpm=tpm,
        max_concurrent=max_concurrent, admin=admin,
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
    reloads."""

    def __init__(self, path: Path, *, open_when_empty: bool):
        self.path = path
        self.open_when_empty = open_when_empty
        self._by_id: dict[str, KeyRecord] = {}
        self._usage: dict[str, KeyUsage] = {}
        # key id -> SHA-256 of a secret that passed the KDF: later requests
        # with that key cost one fast hash instead of 100k iterations.
        self._verified: dict[str, bytes] = {}
        self.anonymous = Principal(ANONYMOUS, admin=True, usage=KeyUsage())
        self.reload()

    def reload(self) -> int:
        """Re-read the file (KeyFileError keeps the old keys); how many keys."""
        records = read_keys(self.path)
        self._by_id = {r.key_id: r for r in records}
        self._verified = {}
        for r in records:
            if r.name in self._usage:
                self._usage[r.name].set_limits(r.limits)
            else:
                self._usage[r.name] = KeyUsage(r.limits)
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

    async def authenticate(self, presented: str | None) -> Principal | None:
        """The key's principal, or None for a missing, malformed or unknown key."""
        parts = split_key(presented) if presented else None
        record = self._by_id.get(parts[0]) if parts else None
        if record is None:
            return None
        key_id, secret = parts
        quick = hashlib.sha256(secret.encode()).digest()
        known = self._verified.get(key_id)
        if known is not None:
            ok = hmac.compare_digest(known, quick)
        else:
            ok = await asyncio.to_thread(record.matches, secret)
            if ok and self._by_id.get(key_id) is record:  # not reloaded meanwhile
                self._verified[key_id] = quick
        return self._principal(record) if ok else None


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
    Plain ASGI, so streaming responses pass through untouched."""

    def __init__(self, app, keys: KeyStore, metrics_requires_key: bool, on_failure=None):
        self.app = app
        self.keys = keys
        self.metrics_requires_key = metrics_requires_key
        self.on_failure = on_failure or (lambda reason: None)

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
            principal = await self.keys.authenticate(presented)
            if principal is None:
                return await self._refuse(scope, send, "invalid", "invalid API key")
        token = _current.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)

    async def _refuse(self, scope, send, reason: str, message: str) -> None:
        self.on_failure(reason)
        response = error_response(
            scope["path"], 401, message, code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, None, send)
