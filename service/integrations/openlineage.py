"""OpenLineage run events per job, through the openlineage-python client: START when an attempt
starts, COMPLETE / FAIL / ABORT when the job ends. Inputs are datasets versioned by their Hub
commit sha (or, for local checkpoints, their content digest), the output carries its sha256s,
the recipe is a job facet. Optional: LAYERSWAP_OPENLINEAGE_URL (http transport), or the
client's own configuration (OPENLINEAGE_URL, OPENLINEAGE_CONFIG). Best effort: a lineage
backend that is down is logged, never fails a job."""

from __future__ import annotations

import functools
import logging
import os
import uuid
from datetime import UTC, datetime
from typing import Any

import attr
from openlineage.client.generated.base import DatasetFacet, JobFacet
from sqlalchemy import select

from service.db.models import Artifact, Job, LineageEdge
from service.db.session import Database
from service.settings import Settings

log = logging.getLogger("layerswap.openlineage")
PRODUCER = "https://github.com/layerswap/layerswap"
FACET_SCHEMA = "https://layerswap.dev/spec/facets/1-0-0/{}.json"


@functools.cache
def _client(url: str | None) -> Any:
    from openlineage.client import OpenLineageClient

    if url:
        return OpenLineageClient(config={"transport": {"type": "http", "url": url, "timeout": 5}})
    return OpenLineageClient()  # its own configuration: OPENLINEAGE_URL / OPENLINEAGE_CONFIG


def enabled(settings: Settings) -> bool:
    return bool(
        settings.openlineage_url or os.environ.get("OPENLINEAGE_URL")
        or os.environ.get("OPENLINEAGE_CONFIG")
    )  # fmt: skip


def job_started(db: Database, settings: Settings, job_id: str, attempt: int) -> None:
    if enabled(settings):
        _emit(db, settings, job_id, "START", attempt=attempt)


def job_ended(db: Database, settings: Settings, job_id: str) -> None:
    """COMPLETE, FAIL or ABORT for a job that has ended (nothing for one re-queued)."""
    if enabled(settings):
        _emit(db, settings, job_id, None)


def _emit(
    db: Database, settings: Settings, job_id: str, event_type: str | None, attempt: int = 0
) -> None:
    from openlineage.client.event_v2 import Job as OLJob
    from openlineage.client.event_v2 import Run, RunEvent, RunState
    from openlineage.client.facet_v2 import error_message_run, job_type_job

    with db.session() as session:
        job = session.get(Job, job_id)
        if job is None:
            return
        state = event_type or {"succeeded": "COMPLETE", "failed": "FAIL", "canceled": "ABORT"}.get(
            job.status
        )
        if state is None:
            return  # re-queued: the run goes on
        edges = session.execute(
            select(LineageEdge, Artifact)
            .join(Artifact, Artifact.id == LineageEdge.artifact_id)
            .where(LineageEdge.job_id == job_id)
        ).all()
        session.expunge_all()
    run_facets: dict[str, Any] = {}
    if state == "FAIL" and job.error:
        run_facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
            message=f"{job.error.get('code')}: {job.error.get('message')}",
            programmingLanguage="python",
        )
    job_facets: dict[str, Any] = {
        "jobType": job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration="LAYERSWAP", jobType=job.kind.upper()
        ),
        "layerswap_request": RequestJobFacet(kind=job.kind, request=job.request, producer=PRODUCER),
    }
    inputs = [_dataset(a, output=False) for e, a in edges if e.direction == "input"]
    if state == "START" and not inputs:  # lineage is recorded at the end; name the sources
        inputs = [_named(source) for source in _sources(job)]
    outputs = [_dataset(a, output=True) for e, a in edges if e.direction == "output"]
    event = RunEvent(
        eventType=getattr(RunState, state),
        eventTime=datetime.now(UTC).isoformat(),
        run=Run(runId=str(uuid.UUID(job.id)), facets=run_facets),
        job=OLJob(
            namespace=settings.openlineage_namespace,
            name=f"{job.tenant_id}.{job.kind}.{job.output_name}",
            facets=job_facets,
        ),
        inputs=inputs,
        outputs=outputs,
        producer=PRODUCER,
    )
    try:
        _client(settings.openlineage_url).emit(event)
    except Exception as e:  # the backend is away: lineage is not worth failing a merge for
        log.warning("job %s: OpenLineage %s event not sent: %s", job_id, state, e)


@attr.define
class RequestJobFacet(JobFacet):
    """The job's request (for merges, the recipe with its Hub sources pinned)."""

    kind: str
    request: dict[str, Any]

    @staticmethod
    def _get_schema() -> str:
        return FACET_SCHEMA.format("RequestJobFacet")


@attr.define
class FilesDatasetFacet(DatasetFacet):
    """Every file of a checkpoint with its sha256."""

    files: dict[str, str]

    @staticmethod
    def _get_schema() -> str:
        return FACET_SCHEMA.format("FilesDatasetFacet")


def _sources(job: Job) -> list[str]:
    from service.kinds import KINDS

    try:
        return list(dict.fromkeys(KINDS[job.kind].sources(job.request)))
    except Exception:
        return []


def _split(location: str) -> tuple[str, str, str | None]:
    """(namespace, name, version) of a location: hf://org/name@sha or a path."""
    if location.startswith("hf://"):
        name, _, sha = location.removeprefix("hf://").partition("@")
        return "huggingface", name, sha or None
    return "file", location, None


def _named(source: str) -> Any:
    from openlineage.client.event_v2 import InputDataset
    from openlineage.client.facet_v2 import dataset_version_dataset

    namespace, name, version = _split(source)
    facets: dict[str, Any] = {}
    if version:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(
            datasetVersion=version
        )
    return InputDataset(namespace=namespace, name=name, facets=facets)


def _dataset(artifact: Artifact, *, output: bool) -> Any:
    from openlineage.client.event_v2 import InputDataset, OutputDataset
    from openlineage.client.facet_v2 import dataset_version_dataset

    namespace, name, version = _split(artifact.location)
    facets: dict[str, Any] = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(
            datasetVersion=version or artifact.content_digest
        )
    }
    if artifact.files:
        facets["layerswap_files"] = FilesDatasetFacet(files=dict(artifact.files), producer=PRODUCER)
    kind = OutputDataset if output else InputDataset
    return kind(namespace=namespace, name=name, facets=facets)
