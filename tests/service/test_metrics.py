"""/metrics computed in SQL (SQLite and PostgreSQL) equals what the job rows say."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import select

from core.db.models import Job, as_utc
from core.jobs import ensure_tenant, new_id
from service.api.meta import BUCKETS
from tests.service.conftest import Service, running_service
from tests.service.test_api_lifecycle import HeldExecutor

T0 = datetime(2026, 1, 2, 3, 4, 5, 250000, tzinfo=UTC)
# Run times in seconds: on bucket edges (le is "at or under"), just past them, sub-second.
MERGE_SECONDS = [0.25, 1.0, 1.001, 5.0, 14.999, 15.0, 60.0, 61.5, 899.999, 3600.0, 7200.125]
ANALYSIS_SECONDS = [0.0, 2.5, 300.0]


def add_job(service: Service, kind: str, status: str, seconds: float | None) -> None:
    started = T0 if seconds is not None else None
    finished = T0 + timedelta(seconds=seconds) if seconds is not None else None
    with service.db.session() as session:
        session.add(
            Job(id=new_id(), tenant_id="default", kind=kind, status=status, request={},
                request_hash="0" * 64, output_name="out", started_at=started,
                finished_at=finished, created_at=T0)
        )  # fmt: skip


def parse(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_duration_histogram_matches_the_rows(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as s:
        ensure_tenant(s.db, "default")
        for seconds in MERGE_SECONDS:
            add_job(s, "merge", "succeeded", seconds)
        for seconds in ANALYSIS_SECONDS:
            add_job(s, "analysis", "succeeded", seconds)
        add_job(s, "merge", "failed", 3.0)  # only succeeded jobs are timed
        add_job(s, "merge", "succeeded", None)  # never started: not timed
        add_job(s, "merge", "queued", None)

        response = s.client.get("/metrics")
        assert response.status_code == 200
        samples = parse(response.text)
        with s.db.session() as session:
            rows = session.execute(
                select(Job.kind, Job.started_at, Job.finished_at).where(
                    Job.status == "succeeded", Job.started_at.is_not(None)
                )
            ).all()

    durations: dict[str, list[float]] = {}
    for kind, started, finished in rows:  # independently: from the rows as read back
        seconds = (as_utc(finished) - as_utc(started)).total_seconds()
        durations.setdefault(kind, []).append(seconds)
    assert sorted(durations["merge"]) == MERGE_SECONDS  # the rows hold what was written
    for kind, values in durations.items():
        for bucket in BUCKETS:
            name = f'layerswap_job_duration_seconds_bucket{{kind="{kind}",le="{bucket}"}}'
            assert samples[name] == sum(v <= bucket for v in values), name
        inf = f'layerswap_job_duration_seconds_bucket{{kind="{kind}",le="+Inf"}}'
        assert samples[inf] == len(values)
        assert samples[f'layerswap_job_duration_seconds_count{{kind="{kind}"}}'] == len(values)
        total = samples[f'layerswap_job_duration_seconds_sum{{kind="{kind}"}}']
        assert abs(total - sum(values)) < 1e-6 * len(values) + 1e-9, (total, sum(values))
    assert samples['layerswap_jobs{kind="merge",status="succeeded"}'] == len(MERGE_SECONDS) + 1
    assert samples['layerswap_jobs{kind="merge",status="failed"}'] == 1
    assert samples['layerswap_jobs{kind="merge",status="queued"}'] == 1
