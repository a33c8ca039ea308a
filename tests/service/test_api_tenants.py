"""Authentication and tenant isolation: API keys stored only as hashes; a tenant sees, cancels
and reads only its own jobs and artifacts (others' ids answer 404, exactly like unknown ones)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import text

from core import jobs
from core.db.models import Job
from core.settings import Settings
from service.auth import create_key
from tests.helpers import wait_for
from tests.service.conftest import TERMINAL, Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from worker.pipeline import run_job

LAYERSWAP = Path(sys.executable).parent / "layerswap"


@pytest.fixture
def secured(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, database_url, examples, auth=True) as running:
        yield running


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_as(service: Service, key: str, job_id: str, kind: str = "merges") -> dict[str, Any]:
    """Service.wait with an API key: poll until the job is finished, up to a deadline."""
    seen: list[dict[str, Any]] = []

    def ended() -> dict[str, Any] | None:
        response = service.client.get(f"/v1/{kind}/{job_id}", headers=bearer(key))
        assert response.status_code == 200, response.text
        seen[:] = [dict(response.json())]
        return seen[0] if seen[0]["status"] in TERMINAL else None

    def still() -> str:
        return f"job {job_id} to end (still {seen[0]['status']})"

    return wait_for(ended, still, 120, interval=0.05)


def on_disk(service: Service, location: str) -> Path:
    """Where a location a tenant is shown lies: it is relative to the source root."""
    return (service.settings.source_roots[0] / location).resolve()


def layerswap(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    return subprocess.run(
        [str(LAYERSWAP), *args],
        env={**clean, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_requests_without_a_valid_key_are_401(secured: Service) -> None:
    key = create_key(secured.db, "a")
    for headers in [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer lsk_not-a-key"},
        {"Authorization": f"Basic {key}"},
        {"Authorization": f"Bearer {key}x"},
        {"Authorization": key},
    ]:
        for method, path in [
            ("GET", "/v1/merges"),
            ("POST", "/v1/merges"),
            ("GET", "/v1/merges/0123"),
            ("POST", "/v1/analyses"),
            ("GET", "/v1/artifacts/0123/lineage"),
        ]:
            kwargs: dict[str, Any] = {"headers": headers}
            if method == "POST":
                kwargs["json"] = layer_swap()
            response = secured.client.request(method, path, **kwargs)
            assert response.status_code == 401, (headers, path, response.text)
            assert response.json()["error"]["code"] == "unauthorized"
    assert secured.client.get("/v1/merges", headers=bearer(key)).status_code == 200
    # Probes and the method list need no key.
    for path in ["/healthz", "/readyz", "/v1/methods"]:
        assert secured.client.get(path).status_code == 200, path


def test_tenants_see_only_their_own_jobs_and_artifacts(secured: Service) -> None:
    a, b = create_key(secured.db, "a"), create_key(secured.db, "b")
    assert a != b
    client = secured.client
    submitted = client.post(
        "/v1/merges", json=layer_swap(), headers={**bearer(a), "Idempotency-Key": "same"}
    )
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    done = wait_as(secured, a, job_id)
    assert done["status"] == "succeeded"
    output = done["output"]["artifact_id"]
    lineage = client.get(f"/v1/artifacts/{output}/lineage", headers=bearer(a)).json()
    source = next(x["id"] for x in lineage["artifacts"] if x["id"] != output)

    # a's analysis to try reading (canceling a's unfinished jobs: the test below).
    analysis = client.post(
        "/v1/analyses",
        json={"base": "base", "experts": [{"label": "math", "path": "math"}]},
        headers=bearer(a),
    )
    assert analysis.status_code == 202
    analysis_id = analysis.json()["id"]
    assert wait_as(secured, a, analysis_id, kind="analyses")["status"] == "succeeded"

    for method, path in [
        ("GET", f"/v1/merges/{job_id}"),
        ("POST", f"/v1/merges/{job_id}/cancel"),
        ("GET", f"/v1/merges/{job_id}/events"),
        ("GET", f"/v1/artifacts/{output}"),
        ("GET", f"/v1/artifacts/{output}/lineage"),
        ("GET", f"/v1/artifacts/{output}/lineage?direction=descendants"),
        ("GET", f"/v1/artifacts/{source}"),
        ("GET", f"/v1/artifacts/{source}/lineage?direction=descendants"),
        ("GET", f"/v1/analyses/{analysis_id}"),
        ("GET", f"/v1/analyses/{analysis_id}/heatmap.png"),
        ("GET", f"/v1/analyses/{analysis_id}/analysis.json"),
    ]:
        theirs = client.request(method, path, headers=bearer(b))
        assert theirs.status_code == 404, (path, theirs.text)
        assert theirs.json()["error"]["code"] == "not_found"
        unknown = client.request(method, path.replace(job_id, "f" * 32), headers=bearer(b))
        assert unknown.status_code == 404
        assert client.request(method, path, headers=bearer(a)).status_code in {200, 409}, path

    # SSE too.
    stream = client.get(
        f"/v1/merges/{job_id}/events", headers={**bearer(b), "Accept": "text/event-stream"}
    )
    assert stream.status_code == 404
    # Listing and filtering show b nothing of a's.
    for params in [{}, {"output_artifact": output}, {"input_artifact": source}]:
        assert client.get("/v1/merges", params=params, headers=bearer(b)).json()["items"] == []
        mine = client.get("/v1/merges", params=params, headers=bearer(a)).json()["items"]
        assert [j["id"] for j in mine] == [job_id]
    # The cancel attempt by b changed nothing.
    assert client.get(f"/v1/merges/{job_id}", headers=bearer(a)).json()["status"] == "succeeded"

    # Idempotency keys are per tenant: b's "same" is b's own job.
    theirs = client.post(
        "/v1/merges", json=layer_swap(), headers={**bearer(b), "Idempotency-Key": "same"}
    )
    assert theirs.status_code == 202
    assert theirs.json()["id"] != job_id
    assert wait_as(secured, b, theirs.json()["id"])["status"] == "succeeded"
    # b's output lies beside a's, not over it.
    b_done = client.get(f"/v1/merges/{theirs.json()['id']}", headers=bearer(b)).json()
    assert Path(b_done["output"]["location"]).parent.name == "b"
    assert Path(done["output"]["location"]).parent.name == "a"


@pytest.fixture
def secured_held(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    """Authentication on; jobs stay queued until the test claims or runs them."""
    with running_service(
        tmp_path, database_url, examples, auth=True, job_executor=HeldExecutor()
    ) as running:
        yield running


def test_a_tenant_cannot_cancel_another_tenants_queued_or_running_job(
    secured_held: Service,
) -> None:
    service = secured_held
    a, b = create_key(service.db, "a"), create_key(service.db, "b")
    queued = service.client.post("/v1/merges", json=layer_swap(), headers=bearer(a)).json()
    running = service.client.post("/v1/merges", json=layer_swap(top=2), headers=bearer(a)).json()
    assert jobs.claim(service.db, running["id"]) == 1  # what a worker does: now it runs

    def state(job_id: str) -> tuple[Any, ...]:
        with service.db.session() as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job.status, job.cancel_requested, job.finished_at, job.attempts

    for job, status in [(queued, "queued"), (running, "running")]:
        before = (
            state(job["id"]),
            service.client.get(f"/v1/merges/{job['id']}/events", headers=bearer(a)).json(),
        )
        assert before[0][0] == status
        theirs = service.client.post(f"/v1/merges/{job['id']}/cancel", headers=bearer(b))
        assert theirs.status_code == 404, theirs.text
        assert theirs.json()["error"]["code"] == "not_found"
        after = (
            state(job["id"]),
            service.client.get(f"/v1/merges/{job['id']}/events", headers=bearer(a)).json(),
        )
        assert after == before, "b's cancel changed a's job"
    # The same requests by the owner do cancel: the 404s were not for want of a cancelable job.
    mine = service.client.post(f"/v1/merges/{queued['id']}/cancel", headers=bearer(a))
    assert mine.status_code == 202 and mine.json()["status"] == "canceled"
    mine = service.client.post(f"/v1/merges/{running['id']}/cancel", headers=bearer(a))
    assert mine.status_code == 202 and mine.json()["status"] == "canceling"


def test_a_tenant_cannot_delete_another_tenants_artifact(secured_held: Service) -> None:
    service = secured_held
    a, b = create_key(service.db, "a"), create_key(service.db, "b")
    job = service.client.post("/v1/merges", json=layer_swap(), headers=bearer(a)).json()
    run_job(job["id"], db=service.db, settings=service.settings)
    output = wait_as(service, a, job["id"])["output"]

    for artifact_id in (output["artifact_id"], "f" * 32):
        theirs = service.client.delete(f"/v1/artifacts/{artifact_id}", headers=bearer(b))
        assert theirs.status_code == 404, theirs.text
        assert theirs.json()["error"]["code"] == "not_found"
    assert on_disk(service, output["location"]).is_dir()
    seen = service.client.get(f"/v1/artifacts/{output['artifact_id']}", headers=bearer(a))
    assert seen.json()["deleted_at"] is None
    mine = service.client.delete(f"/v1/artifacts/{output['artifact_id']}", headers=bearer(a))
    assert mine.status_code == 204
    assert not on_disk(service, output["location"]).exists()


def test_a_tenant_cannot_merge_another_tenants_artifact_by_path(secured: Service) -> None:
    """The artifacts directory is an allowed root, but only for each tenant's own outputs."""
    a, b = create_key(secured.db, "a"), create_key(secured.db, "b")
    job = secured.client.post(
        "/v1/merges", json={**layer_swap(), "output": {"name": "secret"}}, headers=bearer(a)
    ).json()
    location = wait_as(secured, a, job["id"])["output"]["location"]
    assert location == "../artifacts/a/secret"  # as a's sources name it
    absolute = str(on_disk(secured, location))  # a path b might guess
    for source in [absolute, location, "../artifacts/a/../a/secret"]:
        body = {"method": "soup", "models": [source, "swh"]}
        theirs = secured.client.post("/v1/merges", json=body, headers=bearer(b))
        assert theirs.status_code == 422, (source, theirs.text)
        assert theirs.json()["error"]["code"] == "source_not_allowed"
        assert theirs.json()["error"]["details"]["field"] == "models.0"
        analysis = {"base": "base", "experts": [{"label": "x", "path": source}]}
        theirs = secured.client.post("/v1/analyses", json=analysis, headers=bearer(b))
        assert theirs.status_code == 422, (source, theirs.text)
        assert theirs.json()["error"]["code"] == "source_not_allowed"
        # Its owner may.
        mine = secured.client.post("/v1/merges", json=body, headers=bearer(a))
        assert mine.status_code == 202, mine.text
        assert wait_as(secured, a, mine.json()["id"])["status"] == "succeeded"


def test_keys_are_stored_only_as_hashes(secured: Service) -> None:
    keys = [create_key(secured.db, "a"), create_key(secured.db, "a"), create_key(secured.db, "b")]
    assert all(key.startswith("lsk_") and len(key) > 40 for key in keys)
    with secured.db.engine.connect() as connection:
        rows = [tuple(map(str, row)) for row in connection.execute(text("SELECT * FROM api_keys"))]
        hashes = {
            row[0]: row[1]
            for row in connection.execute(text("SELECT key_hash, tenant_id FROM api_keys"))
        }
    assert len(rows) == 3
    for key in keys:
        secret = key.removeprefix("lsk_")
        assert not any(secret in cell for row in rows for cell in row)
        assert hashlib.sha256(key.encode()).hexdigest() in hashes
    assert sorted(hashes.values()) == ["a", "a", "b"]
    # Both of a's keys act for a.
    job = secured.client.post("/v1/merges", json=layer_swap(), headers=bearer(keys[0])).json()
    seen = secured.client.get(f"/v1/merges/{job['id']}", headers=bearer(keys[1]))
    assert seen.status_code == 200
    assert secured.client.get(f"/v1/merges/{job['id']}", headers=bearer(keys[2])).status_code == 404
    wait_as(secured, keys[0], job["id"])


def test_cli_creates_a_key_that_works(secured: Service, tmp_path: Path) -> None:
    env = {
        "LAYERSWAP_DATA_DIR": str(secured.settings.data_dir),
        "LAYERSWAP_DATABASE_URL": secured.settings.database,
    }
    made = layerswap("keys", "create", "--tenant", "cli-tenant", env=env, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    lines = made.stdout.splitlines()
    assert len(lines) == 1, made.stdout
    key = lines[0].strip()
    assert key.startswith("lsk_")
    again = layerswap("keys", "create", "--tenant", "cli-tenant", env=env, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip() != key  # a new key each time

    submitted = secured.client.post("/v1/merges", json=layer_swap(), headers=bearer(key))
    assert submitted.status_code == 202, submitted.text
    done = wait_as(secured, key, submitted.json()["id"])
    assert done["status"] == "succeeded"
    assert Path(done["output"]["location"]).parent.name == "cli-tenant"
    with secured.db.engine.connect() as connection:
        stored = [str(v) for row in connection.execute(text("SELECT * FROM api_keys")) for v in row]
    assert not any(key.removeprefix("lsk_") in value for value in stored)

    missing = layerswap("keys", "create", env=env, cwd=tmp_path)
    assert missing.returncode != 0
    assert "--tenant" in missing.stderr


def test_no_authentication_off_loopback_is_refused(tmp_path: Path) -> None:
    for host in ["0.0.0.0", "192.168.1.10", "::", "example.com"]:
        with pytest.raises(ValidationError, match="without authentication"):
            Settings(host=host, auth=False, data_dir=tmp_path)
        assert Settings(host=host, auth=True, data_dir=tmp_path).auth
    for host in ["127.0.0.1", "localhost", "::1", "127.0.0.2"]:
        assert Settings(host=host, auth=False, data_dir=tmp_path).host == host

    data = tmp_path / "data"
    env = {"LAYERSWAP_DATA_DIR": str(data)}
    refused = layerswap("serve", "--host", "0.0.0.0", "--port", "1", env=env, cwd=tmp_path)
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith("layerswap: error")
    assert "0.0.0.0" in lines[0] and "LAYERSWAP_AUTH" in lines[0]
    assert "serving" not in refused.stdout
    assert not (data / "layerswap.db").exists(), "refused before touching the database"
    # The same through the environment.
    refused = layerswap("serve", env={**env, "LAYERSWAP_HOST": "0.0.0.0"}, cwd=tmp_path)
    assert refused.returncode != 0
    assert len(refused.stderr.strip().splitlines()) == 1
