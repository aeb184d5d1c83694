"""OpenAI-shaped error responses: the one place domain errors become HTTP bodies."""

from __future__ import annotations

from aiohttp import web

from quillcache_core.errors import (
    CapacityExceeded,
    InvalidArgument,
    NodeUnavailable,
    NotFound,
    QuillCacheError,
)


class ApiError(Exception):
    """An error the client should see, with OpenAI's type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers  # sent with the error (429's Retry-After)


def from_domain(exc: QuillCacheError) -> ApiError:
    if isinstance(exc, InvalidArgument):
        return ApiError(400, str(exc))
    if isinstance(exc, NotFound):
        return ApiError(404, str(exc), code="not_found")
    if isinstance(exc, CapacityExceeded):
        return ApiError(429, str(exc), type_="rate_limit_error", headers={"Retry-After": "1"})
    if isinstance(exc, NodeUnavailable):
        return ApiError(503, str(exc), type_="service_unavailable", code="no_engine_available")
    return ApiError(500, str(exc), type_="internal_error")


def body(err: ApiError) -> dict:
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


def response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    if err.headers:
        headers = {**(headers or {}), **err.headers}
    return web.json_response(body(err), status=err.status, headers=headers)
