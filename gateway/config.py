"""specgate's YAML config, validated with pydantic.

A bad config fails at start with the file, the key path and what was
expected, never with a traceback from deep inside the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.checkpoints.default_model import DEFAULT_MODEL_ID

BUILTIN_DEMO = "builtin:demo"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"


class ModelConfig(_Strict):
    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")
    # "builtin:demo", a local model directory, or a hub repo id ("org/name").
    path: str = Field(min_length=1)
    # mlx_plain (batched plain decoding) is always there; mlx_mtp adds MTP
    # speculative decoding with the checkpoint's own head.
    engines: list[Literal["mlx_plain", "mlx_mtp"]] = Field(
        default_factory=lambda: ["mlx_plain"], min_length=1
    )
    mtp_depth: int = Field(2, ge=1, le=8)  # drafts per round for the mtp method
    # Tokens of prompt + completion; default: the model's max_position_embeddings.
    max_context: int | None = Field(None, gt=0)
    max_concurrent: int = Field(8, gt=0, le=256)  # requests decoded together
    max_queue: int = Field(64, ge=0)  # waiting beyond that -> 429
    prefix_cache_size: int = Field(8, ge=0)  # cached prompt prefixes kept


class Config(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> Config:
        ids = [m.id for m in self.models]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"model ids must be unique; repeated: {', '.join(dupes)}")
        return self

    @field_validator("models", mode="before")
    @classmethod
    def _models_is_list(cls, v):
        if isinstance(v, dict):
            raise ValueError("models must be a list of entries, each starting with '- id: ...'")
        return v


class ConfigError(Exception):
    """A config that cannot be used; the message says where and why."""


def default_config() -> Config:
    """What `specgate serve` with no arguments serves."""
    return Config(
        models=[ModelConfig(id=DEFAULT_MODEL_ID, path=BUILTIN_DEMO, engines=["mlx_plain", "mlx_mtp"])]
    )


def _format(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
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


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, str(path))
