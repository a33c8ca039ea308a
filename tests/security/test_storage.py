"""What one tenant may make the service store: a finite quota by default, outputs bounded by
their inputs' size (refused at submit from headers, and again by the worker before it writes),
the quota checked at submit against the planned output, and the database records a tenant's
requests leave counted against it. Over HTTP on SQLite and PostgreSQL."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from core import jobs
from core.db.models import Sweep, WebhookEvent
from core.db.session import Database
from core.quota import record_bytes
from core.settings import Settings
from engine.errors import OutputTooLarge
from engine.merge import MergeOptions, merge, planned_output_bytes
from engine.planner import make_plan
from engine.recipe import parse_recipe
from tests.helpers import leftovers
from tests.service.conftest import Service, layer_swap, open_store, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from worker.pipeline import run_job

ROOT = Path(__file__).resolve().parents[2]
TENANT = "default"
WHOLE = {"sources": [{"model": "math", "layer_range": [0, 6]}]}  # the 6 layers of math/
HALF = {"sources": [{"model": "math", "layer_range": [0, 3]}]}


def passthrough(*slices: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"method": "passthrough", "models": ["math"], "params": {"slices": list(slices)}, **top}


def refused(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = dict(response.json()["error"])
    assert error["code"] == code, error
    return error


def stored_nothing(service: Service) -> None:
    """No job, no record, no output: a refused submit leaves nothing behind."""
    assert service.client.get("/v1/merges").json()["items"] == []
    with service.db.session() as session:
        assert record_bytes(session, TENANT) == 0
    assert not (service.settings.artifacts_dir / TENANT).exists()


def test_the_default_quota_is_finite_and_compose_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LAYERSWAP_TENANT_QUOTA_BYTES", "LAYERSWAP_MAX_OUTPUT_RATIO"):
        monkeypatch.delenv(name, raising=False)
    defaults = Settings()
    assert defaults.tenant_quota_bytes == 100 * 1024**3
    assert defaults.max_output_ratio == 4.0
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        value = (service.get("environment") or {}).get("LAYERSWAP_TENANT_QUOTA_BYTES")
        if value is not None:  # as compose expands ${VAR:-default} with VAR unset
            assert int(re.sub(r"\$\{\w+:-(.*?)\}", r"\1", str(value))) > 0, name


def test_a_passthrough_that_multiplies_the_model_is_refused_at_submit(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with running_service(tmp_path, database_url, examples) as service:
        error = refused(
            service.client.post("/v1/merges", json=passthrough(*[WHOLE] * 64)),
            422,
            "output_too_large",
        )
        details = error["details"]
        assert details["field"] == "params.slices" and error["message"].startswith("params.slices")
        assert details["max_ratio"] == 4.0 and details["ratio"] > 50
        assert details["output_bytes"] > 50 * details["input_bytes"] > 0
        assert str(details["output_bytes"]) in error["message"]

        config = {"merge_method": "passthrough", "slices": [WHOLE] * 64}  # mergekit's own form
        error = refused(
            service.client.post("/v1/merges", json={"mergekit": config}), 422, "output_too_large"
        )
        assert error["details"]["field"] == "mergekit.slices", error
        stored_nothing(service)


def test_legitimate_growth_passes_and_the_ratio_setting_raises_the_bound(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    """At the default bound 6 layers stack into 9 (as 32 into 48: 1.5×), also written as
    float32 from bfloat16 (2× more); 48 layers of 6 (about 7×) need the bound raised."""
    eightfold = passthrough(*[WHOLE] * 8)
    with running_service(tmp_path, database_url, examples) as service:
        for name, extra in [("deeper", {}), ("deeper-f32", {"dtype": "float32"})]:
            body = passthrough(WHOLE, HALF, output={"name": name, **extra})
            done = service.wait(service.submit(body)["id"])
            assert done["status"] == "succeeded", done["error"]
        error = refused(service.client.post("/v1/merges", json=eightfold), 422, "output_too_large")
        assert 6 < error["details"]["ratio"] < 8
    with running_service(tmp_path, database_url, examples, max_output_ratio=8) as service:
        done = service.wait(service.submit(eightfold)["id"])
        assert done["status"] == "succeeded", done["error"]


def test_the_worker_refuses_an_output_too_large_before_writing(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    """Accepted under a looser bound (or from Hub headers the API did not read), the job is
    checked again when it plans, before a byte is written."""
    held = HeldExecutor()
    with running_service(
        tmp_path, database_url, examples, job_executor=held, max_output_ratio=8
    ) as service:
        job = service.submit(passthrough(*[WHOLE] * 8, output={"name": "deep"}))
        strict = service.settings.model_copy(update={"max_output_ratio": 4.0})
        run_job(job["id"], db=service.db, settings=strict)
        failed = service.client.get(f"/v1/merges/{job['id']}").json()
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "output_too_large"
        assert failed["error"]["details"]["field"] == "params.slices"
        assert leftovers(service.settings.artifacts_dir / TENANT / "deep") == []


def test_the_engine_bound_is_the_callers(examples: Path, tmp_path: Path) -> None:
    """The engine alone (the CLI) has no bound unless its caller gives one."""
    recipe = parse_recipe(passthrough(*[WHOLE] * 8))
    resolve = examples.__truediv__
    with pytest.raises(OutputTooLarge):
        merge(recipe, tmp_path / "bounded", resolve=resolve,
              options=MergeOptions(max_output_ratio=4.0, durable=False))  # fmt: skip
    assert leftovers(tmp_path / "bounded") == []
    merged = merge(recipe, tmp_path / "free", resolve=resolve, options=MergeOptions(durable=False))
    assert (merged.out_dir / "model.safetensors").is_file()


def test_the_quota_is_checked_at_submit_against_the_planned_output(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with running_service(tmp_path, database_url, examples, tenant_quota_bytes=4096) as service:
        error = refused(service.client.post("/v1/merges", json=layer_swap()), 409, "quota_exceeded")
        assert error["details"]["planned_bytes"] > 4096
        assert error["details"]["usage_bytes"] == 0 and error["details"]["quota_bytes"] == 4096
        assert "DELETE /v1/artifacts/{id}" in error["message"]
        stored_nothing(service)


def records_of(url: str, tenant: str = TENANT) -> int:
    db = Database(url)
    try:
        with db.session() as session:
            return record_bytes(session, tenant)
    finally:
        db.dispose()


def planned_size(checkpoints: Path, body: dict[str, Any]) -> int:
    """What the output of `body` is planned to take (the engine's figure, from headers)."""
    plan = make_plan(parse_recipe(body), resolve=checkpoints.__truediv__, headers_only=True)
    try:
        return planned_output_bytes(plan)
    finally:
        plan.close()


def test_database_records_count_toward_the_quota(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    held = HeldExecutor()  # jobs stay queued: no artifacts, only records
    with running_service(tmp_path, database_url, examples, job_executor=held) as service:
        for _ in range(3):
            service.submit(layer_swap())
        planned = planned_size(service.checkpoints, layer_swap())
    records = records_of(database_url)
    assert records > 0
    fresh = {"job_executor": HeldExecutor(), "quota_records_refresh_s": 0}
    quota = records + planned - 1  # room for the output, were the records not counted
    with running_service(
        tmp_path, database_url, examples, tenant_quota_bytes=quota, **fresh
    ) as service:
        error = refused(service.client.post("/v1/merges", json=layer_swap()), 409, "quota_exceeded")
        assert error["details"] == {
            "usage_bytes": records, "artifact_bytes": 0, "record_bytes": records,
            "planned_bytes": planned, "quota_bytes": quota,
        }  # fmt: skip
        assert f"{records} by job records" in error["message"]
    with running_service(
        tmp_path, database_url, examples, tenant_quota_bytes=quota + 1, **fresh
    ) as service:
        service.submit(layer_swap())  # one byte more: it fits


def test_record_bytes_sums_what_the_tenants_rows_store(tmp_path: Path, database_url: str) -> None:
    """Jobs (any kind), sweeps and webhook events of the tenant, as stored bytes; the same
    figure on SQLite and PostgreSQL (non-ASCII text included); no other tenant's."""
    with open_store(tmp_path, database_url) as (db, settings):
        jobs.ensure_tenant(db, "other")
        note = "ä" * 10_000  # stored as JSON's \u00e4: 6 bytes each
        jobs.submit(db, settings, jobs.NewJob(TENANT, "analysis", {"note": note}, None, None))
        with db.session() as session:
            after_job = record_bytes(session, TENANT)
            assert 60_000 <= after_job < 61_000
            sweep = {"request": {"spec": "x" * 5000}, "request_hash": "0" * 64, "num_layers": 6}
            session.add(Sweep(id="s" * 32, tenant_id=TENANT, status="running", **sweep))
            event = {"type": "job.succeeded", "subject_id": "j" * 32}
            session.add(
                WebhookEvent(id="msg_1", tenant_id=TENANT, payload={"d": "y" * 3000}, **event)
            )
        with db.session() as session:
            assert 8_000 <= record_bytes(session, TENANT) - after_job < 8_100
            assert record_bytes(session, "other") == 0
