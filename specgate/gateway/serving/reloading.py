"""Hot reload: POST /admin/reload and SIGHUP re-read the config file and
the keys file. A bad file changes nothing (the error names file, key and
value); a good one applies what can change while serving (the models, the
memory budget, the keys) and names what waits for a restart. The config is
read and validated on a worker thread (a bounded job: gateway/config.py
bounds the file and its YAML), so serving goes on meanwhile."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from specgate.gateway.access.auth import KeyStore
from specgate.gateway.access.keys import KeyFileError
from specgate.gateway.config import Config, ConfigError, load_config
from specgate.gateway.serving.footprint import gib
from specgate.gateway.serving.models import ModelRegistry

log = logging.getLogger(__name__)

# Sections a running server cannot change: they keep their running values.
_FIXED_SECTIONS = ("auth", "prefix_cache", "llama_server")


class ReloadRefused(Exception):
    """A file that cannot be used: nothing was changed."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass
class Reloader:
    registry: ModelRegistry
    keys: KeyStore
    running: Config  # as applied: a reload's fixed sections keep these values
    path: Path | None = None  # the config file (None: the embedded default, nothing to re-read)
    overrides: dict = field(default_factory=dict)  # server.host/port from the command line
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def reload(self) -> dict:
        """Apply the files as they are now; ReloadRefused if either is bad."""
        async with self._lock:
            new = await asyncio.to_thread(self._read) if self.path is not None else None
            try:
                count = self.keys.reload()
            except KeyFileError as e:
                raise ReloadRefused(f"keys not reloaded, the old ones stay: {e}", "bad_keys_file") from None
            log.info("reloaded %d API keys from %s", count, self.keys.path)
            result = {"keys": count, "names": self.keys.names}
            if new is None:
                return result
            waiting = restart_needed(self.running, new)
            if new.budgets().prefix_cache != self.registry.prefix_cache_budget and "prefix_cache" not in waiting:
                waiting.append("prefix_cache.ram_bytes (an eighth of server.memory_budget)")
            applied = _applicable(self.running, new)
            changes = await self.registry.reconfigure(applied)
            self.running = applied
            if waiting:
                log.warning("config reload: %s change only at a restart", ", ".join(waiting))
            return result | {
                "models": {"added": list(changes.added), "removed": list(changes.removed),
                           "changed": list(changes.changed), "unchanged": list(changes.unchanged)},
                "restart_needed": waiting,
            }  # fmt: skip

    def _read(self) -> Config:
        try:
            config = load_config(self.path)
        except ConfigError as e:
            raise ReloadRefused(f"config not reloaded, the running one stays:\n{e}", "bad_config") from None
        for key, value in self.overrides.items():
            setattr(config.server, key, value)
        # The prefix cache keeps its RAM until a restart; the new budget must hold it.
        memory, cache = config.budgets().memory, self.registry.prefix_cache_budget
        if cache >= memory:
            raise ReloadRefused(f"config not reloaded, the running one stays: server.memory_budget "
                                f"{gib(memory)} leaves nothing for models beside the prefix cache's "
                                f"{gib(cache)}, whose size changes only at a restart", "bad_config")  # fmt: skip
        return config


def restart_needed(running: Config, new: Config) -> list[str]:
    """What differs in `new` but cannot change while serving."""
    waiting = [s for s in _FIXED_SECTIONS if getattr(running, s) != getattr(new, s)]
    for name in type(running.server).model_fields:
        if name != "memory_budget" and getattr(running.server, name) != getattr(new.server, name):
            waiting.append(f"server.{name}")
    return waiting


def _applicable(running: Config, new: Config) -> Config:
    """`new`, with what cannot change now kept as it runs."""
    server = running.server.model_copy(update={"memory_budget": new.server.memory_budget})
    return new.model_copy(update={"server": server, **{s: getattr(running, s) for s in _FIXED_SECTIONS}})
