"""A job view is made as plain values and serialised without the JobRead model (the answers
of GET and of list pages): its JSON must be exactly what JobRead would write, and show no
more than JobRead has fields for."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from core.db.models import Artifact, Job
from core.settings import Settings
from service.exposure import TenantExposure
from service.schemas import JobRead, job_read, published_view, view_json

NOW = datetime(2026, 3, 1, 12, 30, 15, 123456)


def job(**fields: Any) -> Job:
    values: dict[str, Any] = dict(
        id="a" * 32, tenant_id="t", kind="merge", status="succeeded", stage=None,
        request={"method": "layer_swap", "params": {"bottom": 1, "top": 1.5e-07}},
        output_name="gen1", plan_digest="d" * 64,
        plan_summary=[{"layer": 0, "from": "language"}, {"layer": 1, "from": "task"}],
        bytes_done=10, bytes_total=10, tensors_done=3, tensors_total=3, attempts=1,
        error=None, result={"note": "ünïcode ✓", "big": 2**70, "nan": None},
        sources=None, created_at=NOW, started_at=NOW, finished_at=NOW + timedelta(seconds=3),
    )  # fmt: skip
    values.update(fields)
    return Job(**values)


SOURCE = {"field": "experts.task.0", "source": "hf://o/r", "repo": "o/r", "revision": "main",
          "sha": "f" * 40, "pinned_by": "x"}  # fmt: skip
OUTPUT = {
    "artifact_id": "b" * 32,
    "name": "gen1",
    "location": "/data/artifacts/t/gen1",
    "files": [{"name": "model.safetensors", "sha256": "c" * 64}],
    "published": published_view(
        [{"repo": "org/m", "branch": "main", "commit": "e" * 40, "url": "https://h/x", "at": 1}]
    ),
}

CASES = {
    "succeeded, naive times": job(),
    "aware times": job(created_at=NOW.replace(tzinfo=UTC), finished_at=None),
    "failed, details and an unknown key": job(
        status="failed",
        error={"code": "bad", "message": "no", "details": {"field": "x"}, "trace": "..."},
    ),
    "failed, no details": job(status="failed", error={"code": "bad", "message": "no"}),
    "running, with an ETA": job(
        status="running",
        bytes_done=3,
        started_at=datetime.now(UTC) - timedelta(seconds=5),
        finished_at=None,
    ),
    "queued, pinned Hub sources with an unknown key": job(
        status="queued",
        bytes_done=0,
        started_at=None,
        finished_at=None,
        result=None,
        sources=[SOURCE],
    ),
    "evaluation (requests)": job(kind="evaluation", plan_summary=None),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("output", [None, OUTPUT], ids=["no output", "output"])
def test_a_view_is_what_jobread_writes(case: str, output: dict[str, Any] | None) -> None:
    view = job_read(CASES[case], output)
    written = view_json(view)
    assert written == JobRead.model_validate(view).model_dump_json().encode()
    shown = json.loads(written)
    assert list(shown) == list(JobRead.model_fields)  # the model's fields, in its order


def test_a_view_shows_only_the_models_fields() -> None:
    failed = job_read(CASES["failed, details and an unknown key"], OUTPUT)
    assert failed["error"] == {"code": "bad", "message": "no", "details": {"field": "x"}}
    assert job_read(CASES["failed, no details"])["error"]["details"] == {}
    pinned = job_read(CASES["queued, pinned Hub sources with an unknown key"])
    assert "pinned_by" not in pinned["sources"][0]
    assert OUTPUT["published"] == [
        {"repo": "org/m", "branch": "main", "commit": "e" * 40, "url": "https://h/x"}
    ]
    running = json.loads(view_json(job_read(CASES["running, with an ETA"])))
    assert running["progress"]["eta_s"] > 0
    assert running["created_at"].endswith("Z")


def test_a_tenants_view_is_what_jobread_writes(tmp_path: Any) -> None:
    root = tmp_path / "sources"
    root.mkdir()
    settings = Settings(data_dir=tmp_path / "data", allowed_roots=[root], auth=True)
    output = {**OUTPUT, "location": str(settings.artifacts_dir / "t" / "gen1")}
    failed = job(
        status="failed",
        error={"code": "bad", "message": f"cannot read {root}/x", "details": {"path": str(root)}},
    )
    view = TenantExposure(settings).job(job_read(failed, output))
    assert view_json(view) == JobRead.model_validate(view).model_dump_json().encode()
    assert str(tmp_path) not in view_json(view).decode()
    assert view["output"]["location"] == "../data/artifacts/t/gen1"


def test_an_artifact_column_default_is_not_shown() -> None:
    # published_view of an artifact never published
    assert published_view(Artifact(published=None).published) == []
