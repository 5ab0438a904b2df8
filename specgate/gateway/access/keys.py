"""The keys file: API keys' records, read, validated and written.

A key reads `sg-<id>.<secret>`. The id is a short non-secret handle, so the
server finds a key's record without hashing against every record; the
secret is 256 random bits and the file keeps only its SHA-256. A slow,
salted KDF exists to protect low-entropy passwords from guessing; against
a 256-bit random secret one hash is already out of reach, and a slow one
only hands every client that sends a wrong key ~100 ms of server CPU.
Files written before keep their PBKDF2 records (`scheme: pbkdf2_sha256`),
which still work (gateway/access/auth.py's KeyStore keeps them cheap).
The plaintext is printed once by `specgate keys add` and never stored or
logged. The file (JSON, $SPECGATE_HOME/keys unless `auth.keys_file` says
otherwise) is replaced atomically and readable by its owner only. Every
record is validated when the file is read, so a bad one stops
`specgate serve` (or an /admin/reload, which keeps the old keys) with the
file, the record and the field, instead of failing its key's requests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specgate.engines.home import keys_file
from specgate.gateway.access.quotas import KeyLimits

KEY_PREFIX = "sg-"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
KEY_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # no ".": it ends the id in a key
SHA256 = "sha256"
PBKDF2 = "pbkdf2_sha256"  # files from before SHA-256; read and verified, never written new
PBKDF2_ITERATIONS = 100_000  # what those files used (a record without `iterations`)
# A typo'd iteration count must not turn one key check into minutes of CPU.
MAX_PBKDF2_ITERATIONS = 10_000_000
FILE_VERSION = 2  # 2: records carry `scheme`; 1 (no scheme): every record is PBKDF2


class KeyFileError(Exception):
    """The keys file cannot be read or used; the message says which and why."""


def default_keys_file() -> Path:
    return keys_file()




def sha256_of(secret: str) -> bytes:
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
            digest = sha256_of(secret)
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
        name=name, key_id=key_id, scheme=SHA256, hash=sha256_of(secret).hex(), models=models,
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
