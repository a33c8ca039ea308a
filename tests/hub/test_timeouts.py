"""A Hub that accepts connections and then never answers, or answers one byte per second
(headers included), in its place on the suite's Hub port: pinning at submit, downloading in a
merge and publishing its output each fail with a clear `hub_timeout` once the limits are
passed, after one request (a stuck Hub is not asked again), and the client hangs up."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from core.hub import timeouts
from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from tests.service.test_hub_api import upload
from tests.stuck_server import Mode, StuckServer
from worker.pipeline import run_job

TOKEN = "hf_stuck_hub_0123456789abcdef"
LIMIT_S = 2.0
MODES: list[Mode] = ["silent", "drip"]
HUB_SOURCES = {
    "method": "layer_swap", "params": {"bottom": 1, "top": 1},
    "experts": {"task": ["hf://org/math"], "language": ["hf://org/swh"]},
}  # fmt: skip


@pytest.fixture
def limits() -> Iterator[None]:
    """The process's Hub limits as they were, back after this test: the app (for pinning at
    submit) and each job set them from their Settings, here hub_timeout_s=LIMIT_S."""
    before = timeouts.current()
    yield
    timeouts.configure(before.timeout_s, before.min_bytes_per_s)


@pytest.fixture
def service(tmp_path: Path, examples: Path, hub: Any, limits: None) -> Iterator[Service]:
    hub.add_token(TOKEN, user="team", read=["team/*"], write=["team/*"])
    upload(hub, "org/math", examples / "math")
    upload(hub, "org/swh", examples / "swh")
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples, job_executor=HeldExecutor(),
        hub_credentials={"default": {"team": TOKEN}}, hub_timeout_s=LIMIT_S,
    ) as running:  # fmt: skip
        yield running


@contextmanager
def stuck(hub: Any, mode: Mode) -> Iterator[StuckServer]:
    """A stuck server where the Hub was (the Hub's data is kept for its return)."""
    hub.stop()
    try:
        with StuckServer(mode, port=hub.port) as server:
            yield server
    finally:
        hub.start()


def given_up(server: StuckServer, mode: Mode, message: str) -> None:
    """Asked once, not again; the client hung up; the message says what happened."""
    server.wait_for(lambda s: s.abandoned == 1, "hang-up by the client", timeout=10)
    assert len(server.requests) == 1
    if mode == "silent":
        assert f"the Hub sent nothing for {LIMIT_S:g} s" in message, message
    else:
        assert "slower than 1024 bytes/s" in message, message


def failed(service: Service, job_id: str) -> dict[str, Any]:
    run_job(job_id, db=service.db, settings=service.settings)
    job = dict(service.client.get(f"/v1/merges/{job_id}").json())
    assert (job["status"], job["attempts"]) == ("failed", 1), job
    assert job["error"]["code"] == "hub_timeout", job["error"]
    return job


@pytest.mark.parametrize("mode", MODES)
def test_a_stuck_hub_answers_a_submit_with_hub_timeout(
    service: Service, hub: Any, mode: Mode
) -> None:
    with stuck(hub, mode) as server:
        response = service.client.post("/v1/merges", json=HUB_SOURCES)
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["code"] == "hub_timeout"
        assert error["message"].startswith("hf://org/math@main: ")
        given_up(server, mode, error["message"])
    assert service.client.get("/v1/merges").json()["items"] == []


@pytest.mark.parametrize("mode", MODES)
def test_a_hub_stuck_while_a_merge_downloads_fails_it(
    service: Service, hub: Any, mode: Mode
) -> None:
    job_id = service.submit(HUB_SOURCES)["id"]  # pinned while the Hub answers
    with stuck(hub, mode) as server:
        job = failed(service, job_id)
        assert job["error"]["message"].startswith("hf://org/")
        given_up(server, mode, job["error"]["message"])


@pytest.mark.parametrize("mode", MODES)
def test_a_hub_stuck_while_a_merge_publishes_fails_it(
    service: Service, hub: Any, mode: Mode
) -> None:
    body = {
        **layer_swap(),
        "output": {"name": "out", "hub": {"repo": "team/out", "credential": "team"}},
    }
    job_id = service.submit(body)["id"]
    with stuck(hub, mode) as server:
        job = failed(service, job_id)
        assert job["error"]["message"].startswith("hf://team/out@main: ")
        given_up(server, mode, job["error"]["message"])
    assert not (service.settings.artifacts_dir / "default" / "out").exists()
