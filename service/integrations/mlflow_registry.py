"""MLflow Model Registry: a merge with `output.mlflow` becomes a model version, through MLflow's
own client. The version's source is the published Hub commit (hf://org/name@sha) or, when the
merge was not published, the artifact in this service (layerswap:/v1/artifacts/<id>: MLflow
accepts a local path only inside a run's artifacts). Tags name the job, method, parameters,
inputs with their commits, plan and content digests; evaluation scores are added as tags when
they arrive. Idempotent: the version is looked up by its job-id tag first, so a retried job
never makes a second one."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from service.errors import ServiceError
from service.settings import Settings

log = logging.getLogger("layerswap.mlflow")
T = TypeVar("T")
JOB_TAG = "layerswap.job_id"
TRIES = 4


class MlflowFailed(ServiceError):
    code = "mlflow_failed"
    status = 502


class MlflowNotConfigured(ServiceError):
    code = "mlflow_not_configured"
    status = 422


def check_configured(settings: Settings) -> None:
    if not settings.mlflow_tracking_uri:
        raise MlflowNotConfigured(
            "output.mlflow: this deployment has no MLflow registry "
            "(LAYERSWAP_MLFLOW_TRACKING_URI is not set)",
            details={"field": "output.mlflow"},
        )


def _client(settings: Settings) -> Any:
    from mlflow.tracking import MlflowClient

    uri = settings.mlflow_tracking_uri
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _retrying(what: str, step: Callable[[], T]) -> T:
    """MLflow's client retries its own HTTP calls; this retries the whole step (a lookup, then a
    create) a few times more, and turns a final failure into the job's error."""
    from mlflow.exceptions import MlflowException

    for attempt in range(1, TRIES + 1):
        try:
            return step()
        except MlflowException as e:
            status = int(e.get_http_status_code())  # type: ignore[no-untyped-call]
            if attempt == TRIES or status in (400, 403, 404):
                raise MlflowFailed(
                    f"MLflow registry: {what} failed: {e.message}",
                    details={"error_code": e.error_code},
                ) from None
            log.warning("MLflow %s failed (attempt %d of %d): %s", what, attempt, TRIES, e.message)
            time.sleep(min(2.0**attempt, 10.0))
    raise AssertionError("unreachable")


def _quoted(value: str) -> str:
    """A filter-string literal; names and ids never hold quotes or backslashes (their patterns
    refuse them), so nothing needs escaping."""
    assert "'" not in value and "\\" not in value, value
    return f"'{value}'"


def _by_job(client: Any, name: str, job_id: str) -> Any | None:
    found = client.search_model_versions(
        f"name = {_quoted(name)} and tags.`{JOB_TAG}` = {_quoted(job_id)}"
    )
    return found[0] if found else None


def register(
    settings: Settings,
    *,
    job_id: str,
    request: dict[str, Any],
    destination: Any,
    files: dict[str, str],
    plan_digest: str,
    sources: list[dict[str, Any]],
    published: dict[str, Any] | None,
    artifact_hint: str,
) -> dict[str, Any]:
    """The model version for this job (made once), its alias set. Returns what was recorded."""
    from mlflow.exceptions import MlflowException

    from service.lineage import content_digest

    client = _client(settings)
    name = destination.registered_model
    if published:
        source = f"hf://{published['repo']}@{published['commit']}"
    else:
        source = f"layerswap:{artifact_hint}"
    tags = {
        JOB_TAG: job_id,
        "layerswap.method": str(request.get("method")),
        "layerswap.params": json.dumps(request.get("params", {}), sort_keys=True),
        "layerswap.inputs": json.dumps(sources, sort_keys=True),
        "layerswap.plan_digest": plan_digest,
        "layerswap.content_digest": content_digest(files),
    }

    def step() -> Any:
        try:
            client.create_registered_model(name, description="Merged by Layerswap")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = _by_job(client, name, job_id)
        if version is None:
            version = client.create_model_version(
                name, source, tags=tags, description=f"Layerswap merge job {job_id}"
            )
        if destination.alias:
            client.set_registered_model_alias(name, destination.alias, version.version)
        return version

    version = _retrying(f"registering {name}", step)
    return {
        "tracking_uri": settings.mlflow_tracking_uri,
        "registered_model": name,
        "version": str(version.version),
        "alias": destination.alias,
        "source": source,
    }


def add_scores(
    settings: Settings, registered: dict[str, Any], job_id: str, scores: list[Any]
) -> None:
    """Evaluation scores as tags of the merge's version (eval.<task>.<metric>.<filter>)."""
    client = _client(settings)
    name = registered["registered_model"]

    def step() -> None:
        version = _by_job(client, name, job_id)
        if version is None:
            return
        for score in scores:
            key = f"eval.{score.task}.{score.metric}.{score.filter}"
            client.set_model_version_tag(name, version.version, key, str(score.value))

    _retrying(f"tagging {name} with scores", step)
