"""Request body size limit, as plain ASGI so streaming responses pay nothing."""

from __future__ import annotations

from gateway.errors import error_response


class BodyLimitMiddleware:
    """Answer 413 (OpenAI error shape) for bodies over max_bytes.

    A declared Content-Length is checked before reading anything; a chunked
    body is counted while it arrives, and the app only sees it if it fits.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

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
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._reject(scope, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope, send):
        response = error_response(
            scope["path"], 413, f"request body is larger than {self.max_bytes} bytes",
            code="body_too_large", headers={"connection": "close"},
        )
        await response(scope, None, send)
