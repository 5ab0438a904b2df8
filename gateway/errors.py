"""Errors in the OpenAI API's own shape.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

_TYPES = {
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

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_type_tag(part: object) -> bool:
    """pydantic puts the union member it tried into the error location
    ("stop.str", "prompt.list[int]"); the API's param is the field alone."""
    return isinstance(part, str) and (
        part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "constrained-"))
    )


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
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
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and "parsing the body" in str(exc.detail):
            # FastAPI's words for a body it could not decode (e.g. bad UTF-8).
            return APIError(
                400, "request body is not valid UTF-8 JSON", code="invalid_json"
            ).response()
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}").response()
