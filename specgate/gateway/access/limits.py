"""Request body limits, as plain ASGI so streaming responses pay nothing."""

from __future__ import annotations

import asyncio

from specgate.gateway.errors import error_response


class BodyLimitMiddleware:
    """Answer 413 for bodies over max_bytes, and 408 for a body that stops
    arriving for body_timeout_s or has not arrived whole body_deadline_s
    after its headers (a stuck or slow client, a byte every few seconds,
    must not hold a connection, or later a decoding slot, forever). Errors
    in the shape of the API the path belongs to.

    A declared Content-Length is checked before reading anything; a chunked
    body is counted while it arrives, and the app only sees it if it fits.
    """

    def __init__(self, app, max_bytes: int, body_timeout_s: float = 30.0,
                 body_deadline_s: float = 60.0):  # fmt: skip
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        self.body_deadline_s = body_deadline_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._reject(scope, send)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_deadline_s
        while True:
            stall_at = loop.time() + self.body_timeout_s
            try:
                async with asyncio.timeout_at(min(stall_at, deadline)):
                    message = await receive()
            except TimeoutError:
                why = (f"did not arrive in full within {self.body_deadline_s:g} s" if deadline <= stall_at
                       else f"stopped arriving for {self.body_timeout_s:g} s")  # fmt: skip
                return await self._reject(scope, send, 408, f"request body {why}", "body_timeout")
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._reject(scope, send)
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(b"".join(chunks), receive), send)

    async def _reject(self, scope, send, status: int = 413, message: str | None = None,
                      code: str = "body_too_large"):
        message = message or f"request body is larger than {self.max_bytes} bytes"
        response = error_response(scope["path"], status, message, code=code,
                                  headers={"connection": "close"})  # fmt: skip
        await response(scope, None, send)


def replay(body: bytes, receive):
    """An ASGI receive that gives `body` whole once, then the client's own."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
