"""The one translator from errors to HTTP: `{"error": {"code", "message", "details"}}`.

Never HTML, never a stack trace; 503 with Retry-After when the database is unreachable.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.exceptions import HTTPException

from service.errors import ServiceError
from worker.engine.errors import (
    CheckpointError,
    EngineError,
    IncompatibleCheckpointsError,
    OutputError,
    RecipeError,
)
from worker.engine.recipe import METHODS, recipe_error_from

log = logging.getLogger("layerswap.api")

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


def install(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, e: ServiceError) -> JSONResponse:
        return error_response(e.status, e.code, e.message, e.details)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: EngineError) -> JSONResponse:
        return error_response(ENGINE_STATUS.get(type(e), 422), e.code, e.message, e.details)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = list(e.errors())
        loc: tuple[Any, ...] = tuple(errors[0]["loc"]) if errors else ()
        skip = 1 + (len(loc) > 1 and loc[0] == "body" and loc[1] in METHODS)
        error = recipe_error_from(errors, skip=skip) if errors else RecipeError("invalid request")
        return error_response(422, "invalid_request", error.message, error.details)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(e.status_code, code, str(e.detail))

    @app.exception_handler(OperationalError)
    @app.exception_handler(DBAPIError)
    async def database_down(_: Request, e: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", e)
        return error_response(
            503, "database_unavailable", "the database is unreachable; retry shortly", retry_after=5
        )

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal_error", "unexpected error; see the service log")
