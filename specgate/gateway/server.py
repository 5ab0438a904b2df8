"""The uvicorn server specgate runs: guarded connections and a graceful drain.

- Connections (the protocol class here, a subclass of uvicorn's httptools
  one; every limit holds before anything reaches the app):
  - headers are bounded: uvicorn buffers a request's headers without a
    bound (a 64 MB header to /health was accepted), so what arrives before
    the headers end is counted and answered 431 past
    `server.max_header_bytes`;
  - headers have a deadline: uvicorn times nothing on a fresh connection
    (its keep-alive timer starts at a response's end and stops at the
    first byte after it), so a socket that sends nothing, or a header a
    byte at a time, held its descriptor forever. A request line and headers
    must arrive within `server.header_timeout_s` of the connection's opening
    or of the previous response's end; else the connection is closed (with
    a 408 when part of a request came). An idle keep-alive connection closes
    after `server.keep_alive_timeout_s` (uvicorn's own timer);
  - access/connections.py admits each connection, before reading it: at
    most `server.max_connections_per_client` per client address, and none
    past the descriptors the limit leaves after a reserve. The soft limit
    of open files is raised to the hard one at start (`raise_fd_limit`).
  The body's own limits (size, a stall, a whole-body deadline) are in
  access/limits.py, behind the key check.
- SIGTERM: uvicorn stops listening, waits `timeout_graceful_shutdown` for
  connections and then cancels their tasks, which cuts a stream mid-chunk
  (no error event, no [DONE]). Here the drain comes first: the models'
  registry refuses new and queued requests (503), lets running ones finish
  for `server.shutdown_grace_s`, then stops the engines, so every stream
  still open ends with an error event and [DONE]; uvicorn's own wait then
  finds the connections finishing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import subprocess
import sys

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specgate.gateway.access.connections import ConnectionLimits
from specgate.gateway.config import Config, ServerConfig

log = logging.getLogger(__name__)

# After the drain: time for the streams just ended to write their last bytes.
CLOSE_WAIT_S = 3.0
# macOS: the soft limit of open files may not exceed kern.maxfilesperproc
# (setrlimit fails, even with an unlimited hard limit); OPEN_MAX if that
# cannot be read.
OPEN_MAX = 10240


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE) as far
    as allowed: to the hard limit, on macOS at most what the kernel allows
    a process. Logs the limit once; returns it.

    mlx_lm sets the limits to (2048, 4096) when its utils module is first
    imported (ml-explore/mlx-lm#1589), lowering the hard limit for good: it
    is imported first, so that no later import undoes this, and the hard
    limit is 4096 at most wherever mlx_lm is installed."""
    import mlx_lm.utils  # noqa: F401  (see above)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        log.info("open files: no limit")
        return sys.maxsize
    targets = [hard]
    if sys.platform == "darwin":
        targets = [t if hard == resource.RLIM_INFINITY else min(t, hard)
                   for t in (_max_files_per_process(), OPEN_MAX) if t]  # fmt: skip
    for target in targets:
        if target != resource.RLIM_INFINITY and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        if target == resource.RLIM_INFINITY:
            log.info("open files: no limit (raised from %d)", soft)
            return sys.maxsize
        log.info("open files: at most %d (raised from %d)", target, soft)
        return target
    log.info("open files: at most %d (the hard limit is %s)", soft,
             "none" if hard == resource.RLIM_INFINITY else hard)  # fmt: skip
    return soft


def _max_files_per_process() -> int | None:
    try:
        done = subprocess.run(["sysctl", "-n", "kern.maxfilesperproc"], capture_output=True,
                              text=True, check=True, timeout=5)  # fmt: skip
        return int(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _raw_error(status: bytes, message: str, code: str) -> bytes:
    """A whole HTTP response in the OpenAI error shape, closing the
    connection (the request's path, which names its API, is not known yet)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()  # fmt: skip
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body)  # fmt: skip


def guarded_protocol(server: ServerConfig, limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the connection limits of the module
    docstring: bounded headers, the header deadline, and `limits`' admission."""
    max_header_bytes, header_timeout_s = server.max_header_bytes, server.header_timeout_s
    too_large = _raw_error(b"431 Request Header Fields Too Large",
                           f"request headers are larger than {max_header_bytes} bytes",
                           "headers_too_large")  # fmt: skip
    too_slow = _raw_error(b"408 Request Timeout",
                          f"request headers did not arrive within {header_timeout_s:g} s",
                          "headers_timeout")  # fmt: skip

    class GuardedProtocol(HttpToolsProtocol):
        _in_headers = True  # a new connection's first bytes are a request line
        _header_bytes = 0
        _client: str | None = None  # as limits counts it, once admitted
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._client = limits.admit(self.client[0] if self.client else None)
            if self._client is None:
                transport.close()  # before reading a byte: nothing buffered, nothing answered
                return
            self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            if self._client is not None:
                limits.release(self._client)
                self._client = None
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers, self._header_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._disarm_header_deadline()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            # A pipelined request starts now: its headers came already.
            next_request_waiting = bool(self.pipeline)
            super().on_response_complete()
            if not next_request_waiting and not self.transport.is_closing():
                self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Counted after parsing, so a chunk that ends the headers and
            # carries a large body is never mistaken for a large header.
            if self._in_headers and not self.transport.is_closing():
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self.transport.write(too_large)
                    self.transport.close()

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_late(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            limits.header_timeouts += 1
            # Part of a request came: it gets an answer. An idle connection is
            # closed without one, since a client may be sending its next
            # request just now and would read a 408 as the answer to it.
            if self._in_headers and self._header_bytes:
                self.transport.write(too_slow)
            self.transport.close()

    return GuardedProtocol


class GatewayServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the models first (module docstring)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float):
        super().__init__(config)
        self.gateway_app, self.grace_s = app, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting before the drain
            server.close()
        await self.gateway_app.state.registry.drain(self.grace_s)
        self.config.timeout_graceful_shutdown = CLOSE_WAIT_S
        await super().shutdown(sockets)


def make_server(app: FastAPI, config: Config) -> GatewayServer:
    """uvicorn's loggers go to the root logger's handlers (one format, one
    file); its access log is off: the app writes its own
    (gateway/access/access_log.py)."""
    s = config.server
    limits = ConnectionLimits(s.max_connections_per_client, raise_fd_limit())
    app.state.metrics.connections = limits
    uv = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_level=s.log_level,
        log_config=None,
        access_log=False,
        http=guarded_protocol(s, limits),
        # No websocket routes: an upgrade would hand the connection to a
        # protocol that counts nothing of the limits above.
        ws="none",
        timeout_keep_alive=s.keep_alive_timeout_s,
        timeout_graceful_shutdown=CLOSE_WAIT_S,
    )
    return GatewayServer(uv, app, s.shutdown_grace_s)
