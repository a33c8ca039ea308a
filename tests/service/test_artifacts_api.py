"""DELETE /v1/artifacts/{id} and the per-tenant storage quota, over HTTP on SQLite and
PostgreSQL; the quota check the engine calls, against a real database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.db.models import utcnow
from core.db.session import Database
from core.jobs import ensure_tenant
from core.lineage import get_or_create_artifact
from core.quota import QuotaExceeded, check_room, record_bytes, space_reserver
from core.settings import Settings
from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor, soup
from tests.service.test_store import (
    TENANT,
)
from worker.pipeline import run_job

ANALYSIS = {"base": "base", "experts": [{"label": "math", "path": "math"}]}


def merged(service: Service, body: dict[str, Any]) -> dict[str, Any]:
    done = service.wait(service.submit(body)["id"])
    assert done["status"] == "succeeded", done["error"]
    return dict(done["output"])


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


def test_delete_an_output(service: Service) -> None:
    gen1 = merged(service, {**layer_swap(), "output": {"name": "gen1"}})
    gen2 = merged(service, soup(gen1["location"], "swh", output={"name": "gen2"}))
    before = service.client.get(f"/v1/artifacts/{gen1['artifact_id']}").json()
    assert before["deleted_at"] is None
    on_disk = sum(p.stat().st_size for p in Path(gen1["location"]).iterdir())
    assert before["size_bytes"] == on_disk

    response = service.client.delete(f"/v1/artifacts/{gen1['artifact_id']}")
    assert response.status_code == 204, response.text
    assert not Path(gen1["location"]).exists()
    after = service.client.get(f"/v1/artifacts/{gen1['artifact_id']}").json()
    assert after["deleted_at"] is not None
    assert {k: v for k, v in after.items() if k != "deleted_at"} == {
        k: v for k, v in before.items() if k != "deleted_at"
    }
    # Lineage still shows it, marked deleted.
    lineage = service.client.get(f"/v1/artifacts/{gen2['artifact_id']}/lineage").json()
    shown = {a["id"]: a for a in lineage["artifacts"]}
    assert shown[gen1["artifact_id"]]["deleted_at"] == after["deleted_at"]
    assert shown[gen2["artifact_id"]]["deleted_at"] is None
    assert Path(gen2["location"]).is_dir()  # its descendant is untouched
    # A source naming it is refused; its name is free again, for a new artifact.
    refused = service.client.post("/v1/merges", json=soup(gen1["location"], "swh"))
    assert error_of(refused, 422)["details"]["field"] == "models.0"
    again = merged(service, {**layer_swap(), "output": {"name": "gen1"}})
    assert again["artifact_id"] != gen1["artifact_id"]
    assert service.client.get(f"/v1/artifacts/{again['artifact_id']}").json()["deleted_at"] is None
    # Deleting it again changes nothing (a retried DELETE); the new gen1 stays.
    assert service.client.delete(f"/v1/artifacts/{gen1['artifact_id']}").status_code == 204
    assert Path(again["location"]).is_dir()
    assert error_of(service.client.delete(f"/v1/artifacts/{'f' * 32}"), 404)["code"] == "not_found"


def test_an_input_the_service_did_not_store_is_not_deleted(service: Service) -> None:
    output = merged(service, layer_swap())
    lineage = service.client.get(f"/v1/artifacts/{output['artifact_id']}/lineage").json()
    math = next(a for a in lineage["artifacts"] if Path(a["location"]).name == "math")
    error = error_of(service.client.delete(f"/v1/artifacts/{math['id']}"), 409)
    assert error["code"] == "artifact_not_deletable"
    assert (service.checkpoints / "math" / "config.json").is_file()
    assert service.client.get(f"/v1/artifacts/{math['id']}").json()["deleted_at"] is None


def test_delete_an_analysis(service: Service) -> None:
    job = service.client.post("/v1/analyses", json=ANALYSIS).json()
    done = service.wait(job["id"], kind="analyses")
    artifact_id, location = done["result"]["artifact_id"], Path(done["result"]["location"])
    artifact = service.client.get(f"/v1/artifacts/{artifact_id}").json()
    assert artifact["kind"] == "analysis" and artifact["size_bytes"] > 0
    assert {f["name"] for f in artifact["files"]} == {"analysis.json", "heatmap.png"}

    assert service.client.delete(f"/v1/artifacts/{artifact_id}").status_code == 204
    assert not location.exists()
    assert service.client.get(f"/v1/artifacts/{artifact_id}").json()["deleted_at"]
    gone = service.client.get(f"/v1/analyses/{job['id']}/heatmap.png")
    assert error_of(gone, 404)["code"] == "not_found"


@pytest.fixture
def held(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    """Jobs stay queued unless the test runs them (run_job, as a worker would)."""
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as svc:
        yield svc


def test_delete_is_refused_while_an_unfinished_job_uses_it(held: Service) -> None:
    writer = held.submit({**layer_swap(), "output": {"name": "x"}})
    rewriter = held.submit({**layer_swap(top=2), "output": {"name": "x"}})  # also writes x
    run_job(writer["id"], db=held.db, settings=held.settings)
    output = held.client.get(f"/v1/merges/{writer['id']}").json()["output"]
    reader = held.submit(soup("../artifacts/default/x", "swh"))
    analysis = held.client.post("/v1/analyses", json={**ANALYSIS, "base": output["location"]})
    assert analysis.status_code == 202, analysis.text

    refused = error_of(held.client.delete(f"/v1/artifacts/{output['artifact_id']}"), 409)
    assert refused["code"] == "conflict"
    users = {rewriter["id"], reader["id"], analysis.json()["id"]}
    assert set(refused["details"]["jobs"]) == users
    assert Path(output["location"]).is_dir()

    for job_id in (rewriter["id"], reader["id"]):
        assert held.client.post(f"/v1/merges/{job_id}/cancel").status_code == 202
    still = error_of(held.client.delete(f"/v1/artifacts/{output['artifact_id']}"), 409)
    assert still["details"]["jobs"] == [analysis.json()["id"]]
    run_job(analysis.json()["id"], db=held.db, settings=held.settings)  # finished: not a user
    assert held.client.delete(f"/v1/artifacts/{output['artifact_id']}").status_code == 204
    assert not Path(output["location"]).exists()


# --- quota ---------------------------------------------------------------------------------


def one_output(tmp_path: Path, url: str, examples: Path) -> dict[str, Any]:
    """A first output, made without a quota; its artifact (with size_bytes)."""
    with running_service(tmp_path, url, examples) as first:
        output = merged(first, {**layer_swap(), "output": {"name": "first"}})
        return dict(first.client.get(f"/v1/artifacts/{output['artifact_id']}").json())


def records_of(url: str) -> int:
    """Bytes the database holds for the tenant's jobs (they count against its quota too)."""
    db = Database(url)
    try:
        with db.session() as session:
            return record_bytes(session, TENANT)
    finally:
        db.dispose()


def test_a_tenant_at_its_quota_frees_space_to_submit_again(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    first = one_output(tmp_path, database_url, examples)
    size, records = first["size_bytes"], records_of(database_url)
    quota = size + records
    with running_service(
        tmp_path, database_url, examples, tenant_quota_bytes=quota, quota_records_refresh_s=0
    ) as svc:
        for path, body in [("/v1/merges", layer_swap()), ("/v1/analyses", ANALYSIS)]:
            error = error_of(svc.client.post(path, json=body), 409)
            assert error["code"] == "quota_exceeded"
            assert {k: v for k, v in error["details"].items() if k != "planned_bytes"} == {
                "usage_bytes": quota, "artifact_bytes": size, "record_bytes": records,
                "quota_bytes": quota,
            }  # fmt: skip

        assert svc.client.delete(f"/v1/artifacts/{first['id']}").status_code == 204
        # fits: its planned output (less its card and manifest) and its record within `size`
        again = merged(svc, {**layer_swap(), "output": {"name": "first"}})
        assert Path(again["location"]).is_dir()
        full = error_of(svc.client.post("/v1/merges", json=layer_swap()), 409)
        assert full["code"] == "quota_exceeded"


def test_a_merge_that_would_pass_the_quota_is_refused_before_writing(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    """Accepted while it fit (the submit checks the planned output too), the job is checked
    again before it writes, against what is stored by then."""
    first = one_output(tmp_path, database_url, examples)
    quota = first["size_bytes"] * 3 // 2  # room for half an output more
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as svc:
        queued = svc.submit({**layer_swap(), "output": {"name": "second"}})
        limited = svc.settings.model_copy(update={"tenant_quota_bytes": quota})
        run_job(queued["id"], db=svc.db, settings=limited)
        job = svc.client.get(f"/v1/merges/{queued['id']}").json()
        assert job["status"] == "failed"
        assert job["error"]["code"] == "quota_exceeded", job["error"]
        assert job["error"]["details"]["artifact_bytes"] == first["size_bytes"]
        assert not (svc.settings.artifacts_dir / "default" / "second").exists()


def test_the_quota_check_counts_the_tenants_live_stored_artifacts(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    ensure_tenant(db, "other")
    with db.session() as session:
        for tenant, name, size in [
            (TENANT, "live", 600),
            (TENANT, "gone", 5000),
            ("other", "theirs", 5000),
            (TENANT, "input", None),
        ]:
            artifact = get_or_create_artifact(
                session, tenant=tenant, location=f"/{name}", files={name: "0" * 64}
            )
            artifact.size_bytes = size
            if name == "gone":
                artifact.deleted_at = utcnow()

    unlimited = settings.model_copy(update={"tenant_quota_bytes": 0})
    assert space_reserver(db, unlimited, TENANT) is None  # 0: unlimited, no check
    limited = settings.model_copy(update={"tenant_quota_bytes": 1000})
    reserve = space_reserver(db, limited, TENANT)
    assert reserve is not None
    reserve(400)  # 600 + 400 = the quota: allowed
    with pytest.raises(QuotaExceeded) as refused:
        reserve(401)
    assert refused.value.code == "quota_exceeded" and refused.value.status == 409
    assert refused.value.details == {
        "usage_bytes": 600, "artifact_bytes": 600, "record_bytes": 0, "planned_bytes": 401,
        "quota_bytes": 1000,
    }  # fmt: skip
    other = space_reserver(db, limited, "other")
    assert other is not None
    with pytest.raises(QuotaExceeded):
        other(1)  # 5000 already

    with db.session() as session:
        check_room(session, limited, TENANT)  # 600 < 1000
        check_room(session, limited.model_copy(update={"tenant_quota_bytes": 601}), TENANT)
        with pytest.raises(QuotaExceeded):
            check_room(session, limited.model_copy(update={"tenant_quota_bytes": 600}), TENANT)
