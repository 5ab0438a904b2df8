"""The uvicorn server specgate runs: bounded request headers and a graceful drain.

- Headers: uvicorn's httptools protocol buffers a request's headers without
  a bound (a 64 MB header to /health was accepted), so the protocol class
  here counts what arrives before the headers end and answers 431 past
  `server.max_header_bytes`, before anything reaches the app.
- SIGTERM: uvicorn stops listening, waits `timeout_graceful_shutdown` for
  connections and then cancels their tasks, which cuts a stream mid-chunk
  (no error event, no [DONE]). Here the drain comes first: the models'
  registry refuses new and queued requests (503), lets running ones finish
  for `server.shutdown_grace_s`, then stops the engines, so every stream
  still open ends with an error event and [DONE]; uvicorn's own wait then
  finds the connections finishing.
"""

from __future__ import annotations

import json
import socket

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specgate.gateway.config import Config

# After the drain: time for the streams just ended to write their last bytes.
CLOSE_WAIT_S = 3.0


def bounded_headers_protocol(max_header_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, refusing requests whose headers exceed
    `max_header_bytes` (request line and headers, counted as they arrive)."""
    body = json.dumps({"error": {
        "message": f"request headers are larger than {max_header_bytes} bytes",
        "type": "invalid_request_error", "param": None, "code": "headers_too_large",
    }}).encode()  # fmt: skip
    response = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )

    class BoundedHeadersProtocol(HttpToolsProtocol):
        _in_headers = True  # a new connection's first bytes are a request line
        _header_bytes = 0

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers, self._header_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Counted after parsing, so a chunk that ends the headers and
            # carries a large body is never mistaken for a large header.
            if self._in_headers and not self.transport.is_closing():
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self.transport.write(response)
                    self.transport.close()

    return BoundedHeadersProtocol


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


def make_server(app: FastAPI, config: Config, own_logging: bool = True) -> GatewayServer:
    """own_logging=False: uvicorn's loggers go to the root logger's handlers."""
    s = config.server
    uv = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_level=s.log_level,
        **({} if own_logging else {"log_config": None}),
        http=bounded_headers_protocol(s.max_header_bytes),
        timeout_graceful_shutdown=CLOSE_WAIT_S,
    )
    return GatewayServer(uv, app, s.shutdown_grace_s)
