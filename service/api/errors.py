"""The one translator from errors to HTTP: `{"error": {"code", "message", "details"}}`.

Never HTML, never a stack trace; 503 with Retry-After when the database is unreachable.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
from starlette.exceptions import HTTPException

from core.errors import API_ADVICE, ServiceError
from core.hub.errors import HubError
from engine.errors import (
    CheckpointError,
    EngineError,
    IncompatibleCheckpointsError,
    OutputError,
    RecipeError,
)
from engine.methods import METHODS
from engine.recipe import recipe_error_from
from service.exposure import Exposure, exposure_for
from service.tracebacks import bounded_traceback

log = logging.getLogger("layerswap.api")
BODY_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's words for an undecodable body

ENGINE_STATUS: dict[type[EngineError], int] = {
    RecipeError: 422,
    CheckpointError: 422,
    IncompatibleCheckpointsError: 422,
    OutputError: 409,
}


def error_response(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    *,
    retry_after: int | None = None,
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def is_database_outage(e: DBAPIError) -> bool:
    """Unreachable, or reachable but not migrated: retrying later can help. Anything else (an
    integrity or data error) is a bug, not an outage."""
    return isinstance(e, OperationalError | InterfaceError | ProgrammingError) or bool(
        e.connection_invalidated
    )


def describe_invalid(errors: list[Any]) -> tuple[str, dict[str, Any]]:
    """One message and `details.field` from FastAPI's validation errors: the body's field
    (dotted, as in the recipe), or the header/query/path parameter as the client spelled it."""
    if not errors:
        return "body: invalid request", {"field": "body"}
    first = errors[0]
    loc: tuple[Any, ...] = tuple(first["loc"])
    where = str(loc[0]) if loc else "body"
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error") or first["msg"]
        return f"body: not valid JSON: {reason}", {"field": "body"}
    if where != "body":
        field = ".".join(str(part) for part in loc[1:]) or where
        return f"{field}: {first['msg']}", {"field": field, "in": where}
    if not isinstance(first.get("input"), dict) and len(loc) == 1:  # an array, a string, null
        return 'body: must be a JSON object: a recipe, or {"mergekit": config}', {"field": "body"}
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        got = first.get("ctx", {}).get("tag")
        return (
            f"method: must be one of {', '.join(METHODS)}, or the body a mergekit config "
            f'{{"mergekit": ...}} (got {got!r})',
            {"field": "method"},
        )
    if len(loc) == 1:  # the body as a whole: missing, or not a JSON object
        return f"body: {first['msg']}", {"field": "body"}
    skip = 1 + (loc[1] in (*METHODS, "mergekit"))  # the union member's tag
    error = recipe_error_from(errors, skip=skip)
    return error.message, error.details


def exposure_of(request: Request) -> Exposure:
    """What this service's answers may show of the server (service/exposure.py): its errors
    carry paths the engine wrote (`<root>/math/config.json: missing`)."""
    return exposure_for(request.app.state.context.settings)


async def _service_error(request: Request, e: ServiceError) -> JSONResponse:
    shown = exposure_of(request)
    return error_response(e.status, e.code, shown.text(e.message), shown.value(e.details))


async def _engine_error(request: Request, e: EngineError) -> JSONResponse:
    shown = exposure_of(request)
    message, details = shown.text(e.advised(API_ADVICE)), shown.value(e.details)
    if isinstance(e, HubError):  # at submit time: pinning a source to its commit
        retry = 30 if e.http_status == 503 else None
        return error_response(e.http_status, e.code, message, details, retry_after=retry)
    return error_response(ENGINE_STATUS.get(type(e), 422), e.code, message, details)


async def _invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
    message, details = describe_invalid(list(e.errors()))
    return error_response(422, "invalid_request", message, details)


async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 400 and e.detail == BODY_PARSE_ERROR:  # e.g. not UTF-8
        return error_response(422, "invalid_request", "body: not valid JSON", {"field": "body"})
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    return error_response(e.status_code, code, str(e.detail))


async def _database_error(_: Request, e: DBAPIError) -> JSONResponse:
    if is_database_outage(e):
        log.warning("database unavailable: %s", e)
        return error_response(
            503,
            "database_unavailable",
            "the database is unreachable; retry shortly",
            retry_after=5,
        )
    log.error("database error\n%s", bounded_traceback(e))
    return error_response(500, "internal_error", "unexpected error; see the service log")


async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    # Bounded: a request can make a traceback as large as it likes (service/tracebacks.py).
    log.error("unhandled error\n%s", bounded_traceback(e))
    return error_response(500, "internal_error", "unexpected error; see the service log")


def install(app: FastAPI) -> None:
    """Every error answered as `{"error": {...}}`: ours and the engine's by their status,
    FastAPI's own in our words, an unreachable database a 503, anything else a 500."""
    app.exception_handler(ServiceError)(_service_error)
    app.exception_handler(EngineError)(_engine_error)
    app.exception_handler(RequestValidationError)(_invalid_request)
    app.exception_handler(HTTPException)(_http_error)
    app.exception_handler(DBAPIError)(_database_error)
    app.exception_handler(Exception)(_unexpected)
