"""Evaluation errors: stable codes, as the service's other errors."""

from __future__ import annotations

from core.errors import ServiceError


class EvaluationUnavailable(ServiceError):
    """lm-eval (the `eval` extra) or the asked-for backend is not installed here."""

    code = "evaluation_unavailable"
    status = 501


class BackendNotOffered(ServiceError):
    """The request asks for a backend no worker of this deployment offers
    (LAYERSWAP_EVAL_BACKENDS): a request error, refused before anything is queued."""

    code = "backend_not_offered"
    status = 422


class UnknownTask(ServiceError):
    code = "unknown_task"
    status = 422


class EvaluationTimeout(ServiceError):
    """The evaluation ran past LAYERSWAP_EVAL_TIMEOUT_S."""

    code = "evaluation_timeout"
    status = 422


class EvaluationFailed(ServiceError):
    """lm-eval raised: the model or the task could not be run (message says why)."""

    code = "evaluation_failed"
    status = 422
