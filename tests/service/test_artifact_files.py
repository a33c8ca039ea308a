"""GET /v1/artifacts/{id}/files and /files/{name}: a stored artifact's files, listed with their
sizes and streamed one by one, confined to the artifact's directory: no climbing, no absolute
names, no links out, no other tenant's artifact, nothing of an input or a deleted artifact."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.auth import create_key
from tests.helpers import wait_for
from tests.service.conftest import TERMINAL, Service, layer_swap, running_service

SECRET = "not for tenants: the server's own file"


@pytest.fixture
def sqlite_service(tmp_path: Path, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, f"sqlite:///{tmp_path / 'layerswap.db'}", examples) as s:
        yield s


def merged(service: Service, **headers: str) -> dict[str, Any]:
    job = service.submit({**layer_swap(), "output": {"name": "served"}}, **headers)

    def ended() -> dict[str, Any] | None:
        found = dict(service.client.get(f"/v1/merges/{job['id']}", headers=headers).json())
        return found if found["status"] in TERMINAL else None

    done = wait_for(ended, f"merge {job['id']} to end", 120, interval=0.05)
    assert done["status"] == "succeeded", done["error"]
    return dict(done["output"])


def code_of(response: Any, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["error"]["code"])


def test_an_outputs_files_are_listed_with_their_sizes_and_served(sqlite_service: Service) -> None:
    output = merged(sqlite_service)
    base = f"/v1/artifacts/{output['artifact_id']}/files"
    listed = sqlite_service.client.get(base).json()["files"]
    on_disk = {p.name: p for p in Path(output["location"]).iterdir()}
    assert [f["name"] for f in listed] == sorted(f["name"] for f in output["files"])
    assert {"README.md", "layerswap.json", "config.json"} <= {f["name"] for f in listed}
    for file in listed:
        assert file["size"] == on_disk[file["name"]].stat().st_size > 0, file
        served = sqlite_service.client.get(f"{base}/{file['name']}")
        assert served.status_code == 200, served.text
        assert served.content == on_disk[file["name"]].read_bytes()
        assert hashlib.sha256(served.content).hexdigest() == file["sha256"]
        assert served.headers["content-disposition"].startswith("attachment")
    card = sqlite_service.client.get(f"{base}/README.md")
    assert card.text.startswith("---") and "layer_swap" in card.text


@pytest.mark.parametrize(
    "name",
    ["%2E%2E/%2E%2E/secret.txt", "..%2F..%2Fsecret.txt", "%2F{root}/secret.txt",
     "README.md/%2E%2E/%2E%2E/%2E%2E/secret.txt", "..%5C..%5Csecret.txt"],
)  # fmt: skip
def test_names_that_climb_or_are_absolute_are_refused(sqlite_service: Service, name: str) -> None:
    output = merged(sqlite_service)
    secret = Path(output["location"]).parents[1] / "secret.txt"
    secret.write_text(SECRET)
    root = str(secret.parent).lstrip("/")
    url = f"/v1/artifacts/{output['artifact_id']}/files/{name.format(root=root)}"
    response = sqlite_service.client.get(url)
    assert code_of(response, 422) == "invalid_request"
    assert SECRET not in response.text


def test_a_link_out_of_the_directory_is_refused(sqlite_service: Service) -> None:
    output = merged(sqlite_service)
    location = Path(output["location"])
    secret = location.parent / "secret.txt"
    secret.write_text(SECRET)
    (location / "README.md").unlink()
    (location / "README.md").symlink_to(secret)
    (location / "extra.txt").write_text("not one of the artifact's files")
    base = f"/v1/artifacts/{output['artifact_id']}/files"
    response = sqlite_service.client.get(f"{base}/README.md")
    assert code_of(response, 403) == "forbidden" and SECRET not in response.text
    assert code_of(sqlite_service.client.get(f"{base}/extra.txt"), 404) == "not_found"
    listed = {f["name"]: f["size"] for f in sqlite_service.client.get(base).json()["files"]}
    assert listed["README.md"] is None and listed["config.json"] is not None
    assert "extra.txt" not in listed


def test_inputs_and_deleted_artifacts_serve_no_files(sqlite_service: Service) -> None:
    output = merged(sqlite_service)
    lineage = sqlite_service.client.get(f"/v1/artifacts/{output['artifact_id']}/lineage").json()
    inputs = [a["id"] for a in lineage["artifacts"] if a["id"] != output["artifact_id"]]
    assert inputs
    for artifact_id in inputs:  # read from the source root, never stored by the service
        response = sqlite_service.client.get(f"/v1/artifacts/{artifact_id}/files/config.json")
        assert code_of(response, 404) == "not_found"
    base = f"/v1/artifacts/{output['artifact_id']}/files"
    assert sqlite_service.client.delete(f"/v1/artifacts/{output['artifact_id']}").status_code == 204
    assert code_of(sqlite_service.client.get(base), 404) == "not_found"
    assert code_of(sqlite_service.client.get(f"{base}/config.json"), 404) == "not_found"


def test_another_tenants_artifact_files_are_not_found(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, auth=True) as s:
        mine = {"Authorization": f"Bearer {create_key(s.db, 'team-a')}"}
        theirs = {"Authorization": f"Bearer {create_key(s.db, 'team-b')}"}
        output = merged(s, **mine)
        base = f"/v1/artifacts/{output['artifact_id']}/files"
        assert s.client.get(f"{base}/config.json", headers=mine).status_code == 200
        assert code_of(s.client.get(f"{base}/config.json"), 401) == "unauthorized"
        for path in (base, f"{base}/config.json"):
            assert code_of(s.client.get(path, headers=theirs), 404) == "not_found"
