"""What answers show of the server (service/exposure.py): with auth on, a tenant sees no server
path (locations, results, 4xx messages and details, a failed job's error and events) and no
operator setting (the MLflow tracking URI); what it sees stays usable (an output's location
works as a source). With auth off, the one local user sees absolute paths as before."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.db.models import Artifact, Job
from core.settings import Settings
from service.auth import create_key
from service.exposure import TenantExposure
from tests.service.conftest import Service, layer_swap, make_settings, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from tests.service.test_api_tenants import bearer, wait_as
from worker.pipeline import run_job


class Answers:
    """A tenant's client that keeps every answer body, to look for the server's paths."""

    def __init__(self, service: Service, tenant: str) -> None:
        self.service = service
        self.key = create_key(service.db, tenant)
        self.headers = bearer(self.key)
        self.bodies: list[tuple[str, str]] = []

    def call(self, method: str, path: str, **kwargs: Any) -> Any:  # the client's Response
        headers = {**self.headers, **kwargs.pop("headers", {})}
        response = self.service.client.request(method, path, headers=headers, **kwargs)
        self.bodies.append((f"{method} {path} -> {response.status_code}", response.text))
        return response

    def finished(self, kind: str, job_id: str) -> dict[str, Any]:
        done = wait_as(self.service, self.key, job_id, kind)
        self.call("GET", f"/v1/{kind}/{job_id}")
        return done

    def assert_no_server_path(self, root: Path) -> None:
        """`root` holds the data directory and every allowed root of the service."""
        assert self.bodies
        for what, body in self.bodies:
            assert str(root) not in body, f"{what}: {body[:600]}"


@pytest.fixture
def secured(tmp_path: Path, examples: Path) -> Iterator[Service]:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, auth=True) as running:
        yield running


def test_a_tenant_sees_no_server_path_and_its_locations_work_as_sources(
    secured: Service, tmp_path: Path
) -> None:
    a = Answers(secured, "a")
    job = a.call("POST", "/v1/merges", json={**layer_swap(), "output": {"name": "gen1"}}).json()
    output = a.finished("merges", job["id"])["output"]
    assert output["location"] == "../artifacts/a/gen1"  # relative to the source root
    a.call("GET", "/v1/merges")
    a.call("GET", f"/v1/merges/{job['id']}/events")
    artifact = a.call("GET", f"/v1/artifacts/{output['artifact_id']}").json()
    assert artifact["location"] == "../artifacts/a/gen1"
    lineage = a.call("GET", f"/v1/artifacts/{output['artifact_id']}/lineage").json()
    assert {x["location"] for x in lineage["artifacts"]} == {"../artifacts/a/gen1", "math", "swh"}

    # The location, given back as it is, is the output.
    again = a.call(
        "POST", "/v1/merges", json={"method": "soup", "models": [output["location"], "swh"]}
    )
    assert again.status_code == 202, again.text
    assert a.finished("merges", again.json()["id"])["status"] == "succeeded"
    ancestors = a.call("GET", f"/v1/merges/{again.json()['id']}").json()["request"]["models"]
    assert ancestors[0] == "../artifacts/a/gen1"

    analysis = a.call(
        "POST", "/v1/analyses", json={"base": "base", "experts": [{"label": "m", "path": "math"}]}
    )
    done = a.finished("analyses", analysis.json()["id"])
    assert done["result"]["location"] == f"../analyses/a/{done['id']}"

    with secured.db.session() as session:  # the operator's record keeps the real place
        stored = session.get(Artifact, output["artifact_id"])
        assert stored is not None
        assert stored.location == str(secured.settings.artifacts_dir / "a" / "gen1")
    a.assert_no_server_path(tmp_path)


def test_refusals_name_no_server_path_but_say_what_to_do(secured: Service, tmp_path: Path) -> None:
    a = Answers(secured, "a")
    outside = a.call("POST", "/v1/merges", json={"method": "soup", "models": ["/etc", "swh"]})
    assert outside.status_code == 422
    error = outside.json()["error"]
    assert error["code"] == "source_not_allowed"
    assert error["details"] == {"field": "models.0"}  # no allowed_roots
    assert "/etc is outside" in error["message"] and "source root" in error["message"]

    broken = secured.checkpoints / "broken"
    broken.mkdir()
    checked = a.call("POST", "/v1/merges", json={"method": "soup", "models": ["broken", "swh"]})
    assert checked.status_code == 422
    assert checked.json()["error"]["message"] == "broken/config.json: missing"
    assert checked.json()["error"]["details"] == {"path": "broken/config.json"}

    # An absolute path the tenant sent is shown back relative too.
    absolute = str(broken)
    checked = a.call("POST", "/v1/merges", json={"method": "soup", "models": [absolute, "swh"]})
    assert checked.json()["error"]["message"] == "broken/config.json: missing"

    lineage = a.call("GET", f"/v1/artifacts/{merged_output(a)}/lineage").json()
    input_id = next(x["id"] for x in lineage["artifacts"] if x["location"] == "math")
    refused = a.call("DELETE", f"/v1/artifacts/{input_id}")
    assert refused.status_code == 409
    assert refused.json()["error"]["details"] == {"location": "math"}
    a.assert_no_server_path(tmp_path)


def merged_output(a: Answers) -> str:
    job = a.call("POST", "/v1/merges", json=layer_swap()).json()
    return str(a.finished("merges", job["id"])["output"]["artifact_id"])


def test_a_failed_jobs_error_and_events_name_no_server_path(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, auth=True, job_executor=HeldExecutor()) as s:
        a = Answers(s, "a")
        fragile = s.checkpoints / "fragile"
        shutil.copytree(s.checkpoints / "math", fragile)
        job = a.call("POST", "/v1/merges", json={"method": "soup", "models": ["fragile", "swh"]})
        assert job.status_code == 202, job.text
        (fragile / "config.json").unlink()  # gone before a worker reads it
        run_job(job.json()["id"], db=s.db, settings=s.settings)

        with s.db.session() as session:  # the worker wrote the absolute path
            row = session.get(Job, job.json()["id"])
            assert row is not None and row.error is not None
            assert str(fragile) in row.error["message"]
        failed = a.call("GET", f"/v1/merges/{job.json()['id']}").json()
        assert failed["status"] == "failed"
        assert failed["error"]["message"] == "fragile/config.json: missing"
        events = a.call("GET", f"/v1/merges/{job.json()['id']}/events").json()
        assert events[-1]["data"]["message"] == "fragile/config.json: missing"
        stream = a.call(
            "GET", f"/v1/merges/{job.json()['id']}/events", headers={"Accept": "text/event-stream"}
        )
        assert "fragile/config.json: missing" in stream.text
        a.assert_no_server_path(tmp_path)


def test_a_result_leaves_out_the_mlflow_tracking_uri(tmp_path: Path, examples: Path) -> None:
    """The result the registry step records (core/integrations/mlflow_registry.py) names the
    tracking server; a tenant sees the registered model, not the operator's server."""
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    uri = "https://layerswap:s3cret@mlflow.internal.example"
    registered = {"tracking_uri": uri, "registered_model": "swahili-math", "version": "3",
                  "alias": "candidate", "source": "layerswap:/v1/merges/x"}  # fmt: skip
    for auth in (True, False):
        with running_service(tmp_path, url, examples, auth=auth, job_executor=HeldExecutor()) as s:
            tenant = "a" if auth else "default"
            headers = bearer(create_key(s.db, tenant)) if auth else {}
            job = s.client.post("/v1/merges", json=layer_swap(), headers=headers).json()
            with s.db.session() as session:
                row = session.get(Job, job["id"])
                assert row is not None
                row.result = {"mlflow": registered}
            seen = s.client.get(f"/v1/merges/{job['id']}", headers=headers).json()["result"]
            if auth:
                assert seen["mlflow"] == {
                    k: v for k, v in registered.items() if k != "tracking_uri"
                }
                assert "s3cret" not in json.dumps(seen)
            else:  # the operator configured it
                assert seen["mlflow"] == registered


def test_with_auth_off_the_local_user_sees_absolute_paths(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples) as s:
        done = s.wait(s.submit({**layer_swap(), "output": {"name": "gen1"}})["id"])
        assert done["output"]["location"] == str(s.settings.artifacts_dir / "default" / "gen1")
        outside = s.client.post("/v1/merges", json={"method": "soup", "models": ["/etc", "swh"]})
        roots = [str(root) for root in s.settings.source_roots]
        assert outside.json()["error"]["details"] == {"field": "models.0", "allowed_roots": roots}


# --- the rendering itself -----------------------------------------------------------------


def exposure(tmp_path: Path, **overrides: Any) -> tuple[TenantExposure, Settings]:
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", auth=True, **overrides)
    return TenantExposure(settings), settings


def test_paths_in_text_are_found_whole_and_only_at_path_boundaries(tmp_path: Path) -> None:
    shown, settings = exposure(tmp_path)
    data = settings.data_dir.resolve()
    cases = {
        f"{data}/checkpoints/math/config.json: missing": "math/config.json: missing",
        f"cannot write ({data}/artifacts/a/.x-1): full": "cannot write (../artifacts/a/.x-1): full",
        f"'{data}/cache/hub/files' and {data}/checkpoints": "'../cache/hub/files' and .",
        f"{data}base/file and {data}.old": f"{data}base/file and {data}.old",  # other names
        "/etc/passwd, GET /v1/merges/x": "/etc/passwd, GET /v1/merges/x",  # not the server's
    }
    for text, expected in cases.items():
        assert shown.text(text) == expected, text
    assert shown.location("hf://org/math@abc") == "hf://org/math@abc"
    assert shown.location("/moved/elsewhere/gen1") == "gen1"  # outside every known place
    value = {"location": f"{data}/artifacts/a/x", "nested": [{"path": f"{data}/evaluations/a"}],
             "mlflow": {"tracking_uri": "https://m", "version": "1"}, "count": 3}  # fmt: skip
    assert shown.value(value) == {"location": "../artifacts/a/x",
                                  "nested": [{"path": "../evaluations/a"}],
                                  "mlflow": {"version": "1"}, "count": 3}  # fmt: skip


def test_configured_services_urls_are_named_not_quoted(tmp_path: Path) -> None:
    mlflow = "https://layerswap:s3cret@mlflow.internal.example:5000"
    shown, _ = exposure(tmp_path, mlflow_tracking_uri=mlflow)
    quoted = f"MLflow registry: create failed: API request to {mlflow}/api/2.0/x failed"
    assert shown.text(quoted) == (
        "MLflow registry: create failed: API request to <the MLflow server>/api/2.0/x failed"
    )
    rebuilt = "connect to https://layerswap:s3cret@mlflow.internal.example/ failed"
    assert "s3cret" not in shown.text(rebuilt)  # the credentials, wherever they appear
    assert shown.value({"error": quoted})["error"] == shown.text(quoted)


def test_a_directory_outside_the_data_dir_is_shown_by_its_name(tmp_path: Path) -> None:
    tasks = tmp_path / "srv" / "eval-tasks"
    shown, _ = exposure(tmp_path, eval_tasks_dir=tasks)
    assert shown.text(f"{tasks}/mgsm/sw.yaml: bad") == "sw.yaml: bad"
    # `/` as an allowed root is never a prefix: URL paths in messages stay as they are.
    everything, _ = exposure(tmp_path, allowed_roots=[Path("/")])
    assert everything.text("see GET /v1/webhooks/secret") == "see GET /v1/webhooks/secret"
