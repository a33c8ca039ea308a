"""OpenLineage run events per job, through the openlineage-python client: START when an attempt
starts, COMPLETE / FAIL / ABORT when the job ends. Inputs are datasets versioned by their Hub
commit sha (or, for local checkpoints, their content digest), the output carries its sha256s,
the recipe is a job facet. Optional: LAYERSWAP_OPENLINEAGE_URL (http transport), or the
client's own configuration (OPENLINEAGE_URL, OPENLINEAGE_CONFIG).

Best effort, and never in a job's way: an event is made when the job asks (from the database)
and sent later, in order, by a thread of its own, each send given `openlineage_timeout_s` in
all; one the backend does not take in time (down, stuck, answering a byte at a time) is
abandoned and logged. A job neither fails nor waits for lineage."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import attr
from openlineage.client.generated.base import DatasetFacet, JobFacet
from sqlalchemy import select

from core.db.models import Artifact, Job, LineageEdge
from core.db.session import Database
from core.integrations.bounded import Bounded
from core.kinds import KINDS
from core.settings import Settings
from engine.errors import RecipeError

log = logging.getLogger("layerswap.openlineage")
PRODUCER = "https://github.com/layerswap/layerswap"
FACET_SCHEMA = "https://layerswap.dev/spec/facets/1-0-0/{}.json"
CAPACITY = 1000  # events waiting to be sent; past it new ones are dropped (logged)
END_STATES = {"succeeded": "COMPLETE", "failed": "FAIL", "canceled": "ABORT"}
READ_TIMEOUT_S = 5.0  # the http transport's, per read: it ends an abandoned send sooner


@functools.cache
def _client(url: str | None, read_timeout_s: float) -> Any:
    # openlineage: an optional integration, loaded once lineage is configured
    from openlineage.client import OpenLineageClient

    if url:
        transport = {"type": "http", "url": url, "timeout": read_timeout_s}
        return OpenLineageClient(config={"transport": transport})
    return OpenLineageClient()  # its own configuration: OPENLINEAGE_URL / OPENLINEAGE_CONFIG


def enabled(settings: Settings) -> bool:
    return bool(
        settings.openlineage_url or os.environ.get("OPENLINEAGE_URL")
        or os.environ.get("OPENLINEAGE_CONFIG")
    )  # fmt: skip


def job_started(db: Database, settings: Settings, job_id: str, attempt: int) -> None:
    """START, queued for sending; returns at once."""
    if enabled(settings):
        _queue_event(db, settings, job_id, "START")


def job_ended(db: Database, settings: Settings, job_id: str) -> None:
    """COMPLETE, FAIL or ABORT for a job that has ended (nothing for one re-queued), queued for
    sending; returns at once."""
    if enabled(settings):
        _queue_event(db, settings, job_id, None)


def _queue_event(db: Database, settings: Settings, job_id: str, event_type: str | None) -> None:
    try:
        made = _event(db, settings, job_id, event_type)
    except Exception as e:  # boundary: lineage never fails a job (the database is away, say)
        log.warning("job %s: OpenLineage event not made: %s", job_id, e)
        return
    if made is not None:
        state, event = made
        timeout_s = settings.openlineage_timeout_s
        url = settings.openlineage_url
        _SENDER.put(_Outgoing(job_id, state, event, url, timeout_s))


@dataclass(frozen=True)
class _Outgoing:
    job_id: str
    state: str
    event: Any
    url: str | None
    timeout_s: float

    def send(self) -> None:
        client = _client(self.url, min(READ_TIMEOUT_S, self.timeout_s))
        _calls(self.url).call(lambda: client.emit(self.event), self.timeout_s)


class _Sender:
    """Sends events in the order they were made, from a daemon thread of its own."""

    def __init__(self) -> None:
        self._exit_drain = False
        self._start_afresh()
        # A forked worker process starts with no sender and nothing pending (the parent sends
        # what it had), and with a lock no thread of the parent may still hold in it.
        os.register_at_fork(after_in_child=self._start_afresh)

    def _start_afresh(self) -> None:
        self._pending: deque[_Outgoing] = deque()
        self._sending = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, item: _Outgoing) -> None:
        with self._changed:
            if len(self._pending) >= CAPACITY:
                log.warning(
                    "job %s: OpenLineage %s event not sent: %d events already wait for the "
                    "backend", item.job_id, item.state, len(self._pending),
                )  # fmt: skip
                return
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="layerswap-openlineage", daemon=True
                )
                self._thread.start()
            if not self._exit_drain:  # what still waits at exit gets one more deadline
                self._exit_drain = True
                atexit.register(self.drain, item.timeout_s)
            self._changed.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every event made so far was sent or given up (at most `timeout_s`)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: not self._pending and not self._sending, timeout_s
            )

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._pending))
                item = self._pending.popleft()
                self._sending = True
            try:
                item.send()
            except Exception as e:  # boundary: the sender thread lives on; the backend is away, say
                log.warning("job %s: OpenLineage %s event not sent: %s", item.job_id, item.state, e)
            finally:
                with self._changed:
                    self._sending = False
                    self._changed.notify_all()


@functools.cache
def _calls(url: str | None) -> Bounded:
    """One backend's calls: those that hang there do not hold up another backend's."""
    return Bounded("the OpenLineage backend")


_SENDER = _Sender()


def _event(
    db: Database, settings: Settings, job_id: str, event_type: str | None
) -> tuple[str, Any] | None:
    """(state, RunEvent) for the job as it now is; None once re-queued (the run goes on)."""
    # openlineage: optional; loaded only when lineage events are sent
    from openlineage.client.event_v2 import Job as OLJob
    from openlineage.client.event_v2 import Run, RunEvent, RunState

    loaded = _load(db, job_id)
    if loaded is None:
        return None
    job, edges = loaded
    state = event_type or END_STATES.get(job.status)
    if state is None:
        return None  # re-queued: the run goes on
    inputs = [_dataset(a, output=False) for e, a in edges if e.direction == "input"]
    if state == "START" and not inputs:  # lineage is recorded at the end; name the sources
        inputs = [_named(source) for source in _sources(job)]
    outputs = [_dataset(a, output=True) for e, a in edges if e.direction == "output"]
    event = RunEvent(
        eventType=getattr(RunState, state),
        eventTime=datetime.now(UTC).isoformat(),
        run=Run(runId=str(uuid.UUID(job.id)), facets=_run_facets(job, state)),
        job=OLJob(
            namespace=settings.openlineage_namespace,
            name=f"{job.tenant_id}.{job.kind}.{job.output_name}",
            facets=_job_facets(job),
        ),
        inputs=inputs,
        outputs=outputs,
        producer=PRODUCER,
    )
    return state, event


def _load(db: Database, job_id: str) -> tuple[Job, list[Any]] | None:
    """The job and its lineage edges with their artifacts, detached from the session."""
    with db.session() as session:
        job = session.get(Job, job_id)
        if job is None:
            return None
        edges = session.execute(
            select(LineageEdge, Artifact)
            .join(Artifact, Artifact.id == LineageEdge.artifact_id)
            .where(LineageEdge.job_id == job_id)
        ).all()
        session.expunge_all()
    return job, list(edges)


def _run_facets(job: Job, state: str) -> dict[str, Any]:
    # openlineage: optional; loaded only when lineage events are sent
    from openlineage.client.facet_v2 import error_message_run

    if state != "FAIL" or not job.error:
        return {}
    message = f"{job.error.get('code')}: {job.error.get('message')}"
    return {
        "errorMessage": error_message_run.ErrorMessageRunFacet(
            message=message, programmingLanguage="python"
        )
    }


def _job_facets(job: Job) -> dict[str, Any]:
    # openlineage: optional; loaded only when lineage events are sent
    from openlineage.client.facet_v2 import job_type_job

    return {
        "jobType": job_type_job.JobTypeJobFacet(
            processingType="BATCH", integration="LAYERSWAP", jobType=job.kind.upper()
        ),
        "layerswap_request": RequestJobFacet(kind=job.kind, request=job.request, producer=PRODUCER),
    }


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
    try:
        return list(dict.fromkeys(KINDS[job.kind].sources(job.request)))
    except (KeyError, TypeError, RecipeError):  # a request this version no longer reads
        return []


def _split(location: str) -> tuple[str, str, str | None]:
    """(namespace, name, version) of a location: hf://org/name@sha or a path."""
    if location.startswith("hf://"):
        name, _, sha = location.removeprefix("hf://").partition("@")
        return "huggingface", name, sha or None
    return "file", location, None


def _named(source: str) -> Any:
    # openlineage: optional; loaded only when lineage events are sent
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
    # openlineage: optional; loaded only when lineage events are sent
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
