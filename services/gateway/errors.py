"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Every failure the gateway answers with is an `ApiError`; the exception handlers
here turn it (and the bus/store failures behind it) into that shape, so the
official SDK raises its usual typed exceptions (BadRequestError, NotFoundError...).
"""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from shared.bus import BusUnavailable, NoResponders, ReplyTimeout

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # OpenAI answers unknown models this way too
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or error_type(status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer", **self.headers} if self.status == 401 else self.headers
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class StoreUnavailable(ConnectionError):
    """Redis could not be reached (or did not answer within the socket timeout)."""


class StoreBusy(StoreUnavailable):
    """A Redis call waited its whole bound in line for a connection: this gateway is overloaded, Redis is fine."""


_AT = re.compile(r" - at `\$\.?(.*)`$")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def from_validation(e: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """A msgspec decode failure as a 400 whose `param` names the field ("messages[0].role")."""
    text = str(e)
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return ApiError(400, f"the request body is not valid JSON: {text}", "invalid_json")
    m = _AT.search(text)
    param = (m.group(1) or None) if m else None
    if missing := _MISSING.match(text):
        code = "missing_required_parameter"
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    elif text.startswith("Expected `") and ", got `" in text:
        code = "invalid_type"
    else:  # a range, length, pattern or enum violation
        code = "invalid_value"
    return ApiError(400, text, code, param)


# Every 503 is a backend down or busy for now: clients (the openai SDK among them) retry after this much.
RETRY_SOON = {"retry-after": "1"}


def from_exception(e: Exception) -> ApiError:
    """Map the failures behind the gateway to what the agent should see."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, StoreBusy):
        return ApiError(503, f"the gateway is overloaded: {e}; retry", "overloaded", headers=RETRY_SOON)
    if isinstance(e, StoreUnavailable):
        return ApiError(503, f"Redis is unreachable: {e}", "redis_unavailable", headers=RETRY_SOON)
    if isinstance(e, NoResponders):
        return ApiError(503, f"the trajectory manager is unavailable ({e})", "trajectory_unavailable",
                        headers=RETRY_SOON)
    if isinstance(e, BusUnavailable):
        return ApiError(503, f"NATS is unreachable: {e}", "nats_unavailable", headers=RETRY_SOON)
    if isinstance(e, ReplyTimeout):
        return ApiError(504, f"the trajectory manager did not answer in time: {e}", "upstream_timeout")
    log.exception("unhandled error")
    return ApiError(500, "internal error in the gateway", "internal_error")


async def _api_error(request: Request, exc: Exception) -> Response:
    return from_exception(exc).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = {404: f"no route {request.method} {request.url.path}"}.get(exc.status_code, str(exc.detail))
    # Starlette's 405 names the route's methods in `Allow` (RFC 9110 requires it): keep its headers
    return ApiError(exc.status_code, message, code, headers=dict(exc.headers or {})).response()


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    StoreUnavailable: _api_error,
    BusUnavailable: _api_error,
    ReplyTimeout: _api_error,
    HTTPException: _http_error,
    Exception: _api_error,
}
