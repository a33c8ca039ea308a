"""Engine errors: each has a stable `code`, a human message and JSON-able details.

They are plain data (picklable), so they survive crossing a process or Celery boundary.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any, Literal

# What the caller can do about an error. Each surface says it in its own words (the CLI's
# flags, the API's endpoints): the message says what went wrong, the surface adds the remedy.
Remedy = Literal["free_space", "overwrite"]


class EngineError(Exception):
    """Base of every error the engine raises on purpose (anything else is a bug)."""

    code = "engine_error"
    remedy: Remedy | None = None

    def __init__(
        self,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        remedy: Remedy | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details or {}
        if remedy is not None:
            self.remedy = remedy

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details, self.remedy))

    def advised(self, advice: Mapping[Remedy, str]) -> str:
        """The message, then what `advice` (a surface's words for each remedy) says to do."""
        said = advice.get(self.remedy) if self.remedy is not None else None
        return f"{self.message}; {said}" if said else self.message

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


def quoted(value: Any, limit: int = 80) -> str:
    """repr() cut to `limit` characters: inputs can hold megabytes where a word was expected,
    and an error message is one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _rebuild(
    cls: type[EngineError], message: str, details: dict[str, Any], remedy: Remedy | None
) -> EngineError:
    return cls(message, details=details, remedy=remedy)


class RecipeError(EngineError):
    """The recipe is invalid; `details["field"]` names the offending field."""

    code = "invalid_recipe"

    @classmethod
    def for_field(cls, field: str, problem: str) -> RecipeError:
        return cls(f"{field}: {problem}", details={"field": field})


class OutputTooLarge(RecipeError):
    """The planned output is more times the size of its inputs than the caller allows (the
    service's `max_output_ratio`); `details["field"]` names what makes it big."""

    code = "output_too_large"


class CheckpointError(EngineError):
    """A checkpoint is missing, malformed or unsafe; `details["path"]` names the file."""

    code = "invalid_checkpoint"

    @classmethod
    def at(cls, path: object, problem: str) -> CheckpointError:
        return cls(f"{path}: {problem}", details={"path": str(path)})


class IncompatibleCheckpointsError(EngineError):
    """Inputs disagree on architecture, tensor names, shapes or dtypes (listed by name)."""

    code = "incompatible_checkpoints"


class OutputError(EngineError):
    """The output location cannot be used (exists, not writable); one that exists has the
    remedy `overwrite`."""

    code = "output_error"


class DeviceError(EngineError):
    """The requested compute device is not available."""

    code = "device_unavailable"


class MergeCanceled(EngineError):
    """The caller asked to stop; nothing was left behind."""

    code = "canceled"


class DiskFull(EngineError):
    """No space left where the job writes (output, side files, caches). Nothing partial stays;
    the job fails with this code instead of being retried, since a retry would fail the same way
    until space is freed (the remedy `free_space`)."""

    code = "disk_full"
    remedy: Remedy | None = "free_space"

    @classmethod
    def at(cls, path: object, what: str) -> DiskFull:
        return cls(
            f"no space left on the device while writing {what} ({path})",
            details={"path": str(path)},
        )


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC, or EDQUOT (a filesystem quota): both mean 'free space first'."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
