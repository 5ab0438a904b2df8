"""Errors in each API's own shape, chosen by the request's path.

OpenAI:    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}
Ollama:    {"error": ...} (the message alone, as Ollama's clients read it)

Raise `APIError` anywhere below a route; code that answers before routing
(ASGI middleware) calls `error_response(path, ...)` itself.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from specgate.engines.base import EngineOverloaded

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"


def api_of(path: str) -> str:
    """Which API's error shape a path answers in: "anthropic", "ollama" or "openai"."""
    if path.startswith(ANTHROPIC_PREFIX):
        return "anthropic"
    return "ollama" if path.startswith(OLLAMA_PREFIX) else "openai"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self, api: str = "openai") -> dict:
        server_side = self.status >= 500  # e.g. a 502 for a peer's bad answer
        if api == "ollama":
            return {"error": self.message}
        if api == "anthropic":
            default = "api_error" if server_side else "invalid_request_error"
            kind = _ANTHROPIC_TYPES.get(self.status, default)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        default = "server_error" if server_side else "invalid_request_error"
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPES.get(self.status, default),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, api: str = "openai") -> JSONResponse:
        return JSONResponse(self.body(api), status_code=self.status, headers=self.headers)


def error_response(path: str, status: int, message: str, **kwargs) -> JSONResponse:
    """An error answer in the shape of the API that `path` belongs to."""
    return APIError(status, message, **kwargs).response(api_of(path))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: object) -> bool:
    """pydantic puts the union member it tried into the error location
    ("stop.str", "prompt.list[int]"); the API's param is the field alone."""
    return isinstance(part, str) and (
        part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "constrained-"))
    )


def _param_path(error: dict) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body" and not _is_type_tag(p)]


def _validation_error(exc: RequestValidationError) -> APIError:
    # The deepest error first: a union field (Responses' `input`, a string or
    # items) fails once per member, and the member the value was meant for
    # fails deeper than the one whose type it does not have.
    first = max(exc.errors(), key=lambda e: len(_param_path(e)))
    loc = _param_path(first)
    if first.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON", code="invalid_json")
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param:
        msg = f"{param}: {msg}"
    if "input" in first and first.get("type") != "missing":
        shown = json.dumps(first["input"], default=str)
        msg += f" (got {shown[:80]}{'...' if len(shown) > 80 else ''})"
    return APIError(400, msg, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response(api_of(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response(api_of(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):
            # FastAPI's words for a body it could not decode (e.g. bad UTF-8).
            if isinstance(exc.__cause__, RecursionError):  # json.loads' own depth limit
                return error_response(request.url.path, 400,
                                      "request body: JSON nested too deeply to parse",
                                      code="invalid_json")  # fmt: skip
            return error_response(
                request.url.path, 400, "request body is not valid UTF-8 JSON", code="invalid_json"
            )
        return error_response(request.url.path, exc.status_code, str(exc.detail),
                              headers=exc.headers)

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(request: Request, exc: EngineOverloaded):
        # The bounded CPU workers (engines/cpu.py) full, before an engine was asked.
        return error_response(request.url.path, 429, str(exc), code="overloaded",
                              headers={"Retry-After": str(max(1, round(exc.retry_after)))})  # fmt: skip

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}")
