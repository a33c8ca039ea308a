"""Service errors: a stable code, an HTTP status, a message and JSON details. Picklable."""

from __future__ import annotations

from typing import Any

from engine.errors import Remedy

# The API's words for what to do about an engine error (its `remedy`); the CLI has its own. An
# output that exists has none here: the service names its outputs, a caller cannot overwrite one.
API_ADVICE: dict[Remedy, str] = {
    "free_space": "free space (DELETE /v1/artifacts/{id}) and submit again",
}


class ServiceError(Exception):
    code = "service_error"
    status = 400

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,), {"details": self.details})


class InvalidRequest(ServiceError):
    code = "invalid_request"
    status = 422


class NotFound(ServiceError):
    code = "not_found"
    status = 404


class SourceNotAllowed(ServiceError):
    code = "source_not_allowed"
    status = 422


class SourceNotFound(ServiceError):
    code = "source_not_found"
    status = 422


class IdempotencyConflict(ServiceError):
    code = "idempotency_key_reused"
    status = 422


class Conflict(ServiceError):
    code = "conflict"
    status = 409


class Unauthorized(ServiceError):
    code = "unauthorized"
    status = 401


class Forbidden(ServiceError):
    code = "forbidden"
    status = 403


class RequestTooLarge(ServiceError):
    """What a request would store exceeds `max_stored_request_bytes` (core/stored_requests.py);
    `details["field"]` names the largest part."""

    code = "request_too_large"
    status = 413
