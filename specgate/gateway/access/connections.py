"""Who may hold a connection: at most `per_client` per client address, and
none past the process's file-descriptor reserve.

gateway/server.py asks at every new connection, before reading a byte of
it, and closes the ones refused at once: a client that opens sockets and
sends nothing holds no more than its share, and the process never runs out
of descriptors (EMFILE stops accepting altogether, and breaks whatever else
needs a file then: a model's weights, a peer's connection, the prefix
cache's disk tier).
"""

from __future__ import annotations

import logging
import time

from specgate.gateway.access.auth import client_address

log = logging.getLogger(__name__)

REFUSAL_REASONS = ("per_client", "fd_reserve")
WARN_EVERY_S = 60.0  # a flood of refusals logs one warning a minute per reason


def fd_reserve(fd_limit: int) -> int:
    """Descriptors kept from connections for everything else the process
    opens: a quarter of the limit, at most 1024."""
    return min(fd_limit // 4, 1024)


class ConnectionLimits:
    """Open connections by client address (auth.client_address: an IPv6
    client by its /64). per_client 0: no cap per address."""

    def __init__(self, per_client: int, fd_limit: int):
        self.per_client = per_client
        self.fd_limit = fd_limit
        self.max_open = fd_limit - fd_reserve(fd_limit)
        self.open = 0
        self.held: dict[str, int] = {}
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)
        self.header_timeouts = 0  # closed by gateway/server.py's header deadline
        self._warned = dict.fromkeys(REFUSAL_REASONS, -WARN_EVERY_S)

    def admit(self, host: str | None) -> str | None:
        """The client's key, counted as holding one more connection; None
        when it may not (refused, and counted by reason)."""
        client = client_address(host) if host else "unknown"
        if self.open >= self.max_open:
            return self._refuse("fd_reserve", client)
        if self.per_client and self.held.get(client, 0) >= self.per_client:
            return self._refuse("per_client", client)
        self.open += 1
        self.held[client] = self.held.get(client, 0) + 1
        return client

    def release(self, client: str) -> None:
        self.open -= 1
        if (left := self.held[client] - 1) > 0:
            self.held[client] = left
        else:
            del self.held[client]

    def _refuse(self, reason: str, client: str) -> None:
        self.refused[reason] += 1
        now = time.monotonic()
        if now - self._warned[reason] >= WARN_EVERY_S:
            self._warned[reason] = now
            if reason == "fd_reserve":
                log.warning("refusing connections: %d open, the most the file-descriptor limit "
                            "(%d) leaves room for", self.open, self.fd_limit)  # fmt: skip
            else:
                log.warning("refusing connections from %s: it holds %d, the most one client "
                            "may (server.max_connections_per_client)", client, self.per_client)  # fmt: skip
        return None
