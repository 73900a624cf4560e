"""OpenAI's error shape for every error the HTTP API returns:
`{"error": {"message", "type", "param", "code"}}`, whatever raised it (our checks, FastAPI's
request validation, Starlette's 404/405, or a bug: a 500 that still answers in that shape)."""
from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specwhisper.server")

# OpenAI's error `type` by status (its SDKs map statuses to exception classes, not types)
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error",
               499: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(HTTPException):
    """An error answered to the client as is: status, message, the offending field, a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(status_code=status, detail=message, headers=headers)
        self.message, self.param, self.code = message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# Documented in the OpenAPI schema of every endpoint that can answer them.
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def error_responses(*statuses: int) -> dict:
    """FastAPI `responses=` entries for these statuses, all with OpenAI's error body."""
    return {s: {"description": "error", "content": {"application/json": {"schema": ERROR_SCHEMA}}}
            for s in statuses}


def _param(loc) -> str | None:
    """('body', 'temperature') -> 'temperature'; the form field's name as the client sent it."""
    names = [str(x) for x in loc if x not in ("body", "query", "path", "header", "cookie")]
    return names[0] if names else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc, ApiError):
            return error_response(exc.status_code, exc.message, exc.param, exc.code, exc.headers)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        message = "; ".join(f"{_param(e.get('loc', ())) or 'request'}: {e.get('msg', 'invalid')}"
                            for e in errors[:5]) or "invalid request"
        return error_response(422, message, _param(first.get("loc", ())), "invalid_value")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")
