"""MLflow Model Registry: a merge with `output.mlflow` becomes a model version, through MLflow's
own client. The version's source is the published Hub commit (hf://org/name@sha) or, when the
merge was not published, the artifact in this service (layerswap:/v1/artifacts/<id>: MLflow
accepts a local path only inside a run's artifacts). Tags name the job, method, parameters,
inputs with their commits, plan and content digests; evaluation scores are added as tags when
they arrive. Idempotent: the version is looked up by its job-id tag first, so a retried job
never makes a second one.

Registered models belong to the tenant that created them (the `layerswap.tenant` tag, set as the
model is created, so two tenants racing for a new name cannot both get it): a merge of another
tenant, or one naming a model the service did not create, is refused (mlflow_model_forbidden)
before anything is registered or an alias moved. The registry is shared by the deployment, so
names are too: a tenant picks names no other tenant holds.

MLflow's client bounds each read, not a call (its retries alone can last many minutes), so
every call here runs with a deadline for the whole of it (`mlflow_timeout_s`)."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from core.errors import ServiceError
from core.integrations.bounded import Bounded, CallAbandoned
from core.settings import Settings
from engine.io.digests import content_digest

log = logging.getLogger("layerswap.mlflow")
T = TypeVar("T")
JOB_TAG = "layerswap.job_id"
OWNER_TAG = "layerswap.tenant"
TRIES = 4
SUBMIT_CHECK_S = 5.0  # a submit waits this long at most for the registry, then lets the job go


class MlflowFailed(ServiceError):
    code = "mlflow_failed"
    status = 502


class MlflowNotConfigured(ServiceError):
    code = "mlflow_not_configured"
    status = 422


class MlflowModelForbidden(ServiceError):
    code = "mlflow_model_forbidden"
    status = 403


def check_configured(settings: Settings) -> None:
    if not settings.mlflow_tracking_uri:
        raise MlflowNotConfigured(
            "output.mlflow: this deployment has no MLflow registry "
            "(LAYERSWAP_MLFLOW_TRACKING_URI is not set)",
            details={"field": "output.mlflow"},
        )


def _client(settings: Settings) -> Any:
    # mlflow: an optional integration, loaded once a merge registers a model
    from mlflow.tracking import MlflowClient

    uri = settings.mlflow_tracking_uri
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@functools.cache
def _calls(uri: str | None) -> Bounded:
    return Bounded("the MLflow registry")


class _GivenUp(Exception):
    """Raised in a step the job no longer waits for, before it writes anything more."""


def _bounded(
    settings: Settings, what: str, step: Callable[[Callable[[], None]], T], timeout_s: float
) -> T:
    """`_retrying(what, step)` with `timeout_s` for all of it; past that, MlflowFailed. The
    step is handed a check to call before each write: once the job has given up on it (and
    failed), a registry that was only slow gets no version or alias move from it."""
    given_up = threading.Event()

    def check() -> None:
        if given_up.is_set():
            raise _GivenUp(what)

    try:
        return _calls(settings.mlflow_tracking_uri).call(
            lambda: _retrying(what, lambda: step(check)), timeout_s, abandoned=given_up
        )
    except CallAbandoned as e:
        raise MlflowFailed(f"MLflow registry: {what} failed: {e}") from None


def _retrying(what: str, step: Callable[[], T]) -> T:
    """MLflow's client retries its own HTTP calls; this retries the whole step (a lookup, then a
    create) a few times more, and turns a final failure into the job's error."""
    # mlflow: heavy and optional; loaded only when a registry is used
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


def check_destination(settings: Settings, tenant: str, destination: Any) -> None:
    """At submit: refuse a registered model that is not the tenant's (MlflowModelForbidden).
    A registry that does not answer within SUBMIT_CHECK_S lets the job through: registering
    checks again, and the same refusal then fails the job."""
    # mlflow: heavy and optional; loaded only when a registry is used
    from mlflow.exceptions import MlflowException

    check_configured(settings)
    client = _client(settings)
    name = destination.registered_model

    def held() -> tuple[bool, str | None]:
        try:
            model = client.get_registered_model(name)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False, None
            raise
        return True, (model.tags or {}).get(OWNER_TAG)

    try:
        exists, owner = _calls(settings.mlflow_tracking_uri).call(
            held, min(SUBMIT_CHECK_S, settings.mlflow_timeout_s)
        )
    except (CallAbandoned, MlflowException) as e:
        log.warning("output.mlflow: %s not checked at submit (%s); registering checks it", name, e)
        return
    if exists:
        _check_owner(name, tenant, owner)


def _claim(client: Any, name: str, tenant: str) -> None:
    """The registered model `name`, created now owned by `tenant`, or found owned by it. The
    owner tag is given with the creation, so of two tenants racing for a new name one gets it
    and the other is refused."""
    # mlflow: heavy and optional; loaded only when a registry is used
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(
            name, tags={OWNER_TAG: tenant}, description="Merged by Layerswap"
        )
        return
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    _check_owner(name, tenant, (client.get_registered_model(name).tags or {}).get(OWNER_TAG))


def _check_owner(name: str, tenant: str, owner: str | None) -> None:
    if owner == tenant:
        return
    details = {"field": "output.mlflow.registered_model"}
    if owner is None:
        raise MlflowModelForbidden(
            f"output.mlflow.registered_model: {name!r} exists in the MLflow registry but no "
            f"tenant owns it (it has no {OWNER_TAG} tag): choose another name, or ask an "
            f"operator to tag it {OWNER_TAG}=<your tenant>",
            details=details,
        )
    raise MlflowModelForbidden(
        f"output.mlflow.registered_model: {name!r} belongs to another tenant; choose another name",
        details=details,
    )


def register(
    settings: Settings,
    *,
    tenant: str,
    job_id: str,
    request: dict[str, Any],
    destination: Any,
    files: dict[str, str],
    plan_digest: str,
    sources: list[dict[str, Any]],
    published: dict[str, Any] | None,
    artifact_hint: str,
) -> dict[str, Any]:
    """The model version for this job (made once), its alias set. Returns what was recorded.
    MlflowModelForbidden, before anything is written, when the model is not the tenant's."""
    client = _client(settings)
    name = destination.registered_model
    if published:
        source = f"hf://{published['repo']}@{published['commit']}"
    else:
        source = f"layerswap:{artifact_hint}"
    tags = _version_tags(job_id, request, files, plan_digest, sources)
    version = _bounded(
        settings,
        f"registering {name}",
        lambda check: _job_version(
            client, check, name=name, tenant=tenant, job_id=job_id, source=source, tags=tags,
            alias=destination.alias,
        ),
        settings.mlflow_timeout_s,
    )  # fmt: skip
    return {
        "tracking_uri": settings.mlflow_tracking_uri,
        "registered_model": name,
        "version": str(version.version),
        "alias": destination.alias,
        "source": source,
    }


def _job_version(
    client: Any,
    check: Callable[[], None],
    *,
    name: str,
    tenant: str,
    job_id: str,
    source: str,
    tags: dict[str, str],
    alias: str | None,
) -> Any:
    """The job's version of model `name` (created unless there is one), `alias` moved to it;
    `check` called before each write."""
    check()
    _claim(client, name, tenant)
    version = _by_job(client, name, job_id)
    if version is None:
        check()
        version = client.create_model_version(
            name, source, tags=tags, description=f"Layerswap merge job {job_id}"
        )
    if alias:
        check()
        client.set_registered_model_alias(name, alias, version.version)
    return version


def _version_tags(
    job_id: str,
    request: dict[str, Any],
    files: dict[str, str],
    plan_digest: str,
    sources: list[dict[str, Any]],
) -> dict[str, str]:
    return {
        JOB_TAG: job_id,
        "layerswap.method": str(request.get("method")),
        "layerswap.params": json.dumps(request.get("params", {}), sort_keys=True),
        "layerswap.inputs": json.dumps(sources, sort_keys=True),
        "layerswap.plan_digest": plan_digest,
        "layerswap.content_digest": content_digest(files),
    }


def add_scores(
    settings: Settings, registered: dict[str, Any], job_id: str, scores: list[Any]
) -> None:
    """Evaluation scores as tags of the merge's version (eval.<task>.<metric>.<filter>)."""
    client = _client(settings)
    name = registered["registered_model"]

    def step(check: Callable[[], None]) -> None:
        version = _by_job(client, name, job_id)
        if version is None:
            return
        for score in scores:
            key = f"eval.{score.task}.{score.metric}.{score.filter}"
            check()
            client.set_model_version_tag(name, version.version, key, str(score.value))

    _bounded(settings, f"tagging {name} with scores", step, settings.mlflow_timeout_s)
