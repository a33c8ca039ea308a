"""Reads that do not hammer: ETag / If-None-Match → 304, and long polling (?wait= and
Prefer: wait=) woken by the job's change — in-process, and on PostgreSQL from another process
through LISTEN/NOTIFY — on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor


@pytest.fixture
def held(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    """Jobs stay queued until the test changes them."""
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as running:
        yield running


def test_etag_and_304(service: Service) -> None:
    job = service.wait(service.submit(layer_swap())["id"])
    first = service.client.get(f"/v1/merges/{job['id']}")
    etag = first.headers["etag"]
    assert first.status_code == 200 and first.json() == job and etag.startswith('W/"')
    same = service.client.get(f"/v1/merges/{job['id']}", headers={"If-None-Match": etag})
    assert same.status_code == 304 and same.content == b"" and same.headers["etag"] == etag
    listed = service.client.get(
        f"/v1/merges/{job['id']}", headers={"If-None-Match": f'"other", {etag.removeprefix("W/")}'}
    )
    assert listed.status_code == 304  # any of a list; weak comparison
    other = service.client.get(f"/v1/merges/{job['id']}", headers={"If-None-Match": '"stale"'})
    assert other.status_code == 200 and other.json() == job
    assert service.client.get(f"/v1/merges/{'0' * 32}?wait=1").status_code == 404


def test_a_long_poll_returns_when_the_job_changes(held: Service) -> None:
    job = held.submit(layer_swap())
    etag = held.client.get(f"/v1/merges/{job['id']}").headers["etag"]

    started = time.monotonic()
    timed_out = held.client.get(
        f"/v1/merges/{job['id']}", headers={"If-None-Match": etag, "Prefer": "wait=1"}
    )
    assert timed_out.status_code == 304 and time.monotonic() - started >= 1.0

    answer: dict[str, Any] = {}

    def poll() -> None:
        response = held.client.get(
            f"/v1/merges/{job['id']}", params={"wait": 30}, headers={"If-None-Match": etag}
        )
        answer.update(status=response.status_code, body=response.json(), at=time.monotonic())

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)  # let it wait (if it has not yet, it reads the change at once instead)
    canceled_at = time.monotonic()
    assert held.client.post(f"/v1/merges/{job['id']}/cancel").status_code == 202
    poller.join(timeout=30)
    assert answer["status"] == 200 and answer["body"]["status"] == "canceled"
    assert answer["at"] - canceled_at < 5  # woken by the change, not by its 30 s timeout
    ended = held.client.get(f"/v1/merges/{job['id']}", params={"wait": 30})
    assert ended.status_code == 200  # an ended job never waits


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_a_change_made_by_another_process_wakes_the_poll(held: Service) -> None:
    job = held.submit(layer_swap())
    etag = held.client.get(f"/v1/merges/{job['id']}").headers["etag"]
    answer: dict[str, Any] = {}

    def poll() -> None:
        response = held.client.get(
            f"/v1/merges/{job['id']}", params={"wait": 30}, headers={"If-None-Match": etag}
        )
        answer.update(status=response.status_code, body=response.json(), at=time.time())

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.5)
    script = (
        "import time; from service import jobs; from service.db.session import Database\n"
        f"jobs.request_cancel(Database({held.settings.database!r}), tenant='default', "
        f"job_id={job['id']!r})\nprint(time.time())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                          capture_output=True, text=True)  # fmt: skip
    canceled_at = float(done.stdout.split()[-1])
    poller.join(timeout=30)
    assert answer["status"] == 200 and answer["body"]["status"] == "canceled"
    assert answer["at"] - canceled_at < 5  # NOTIFY from the other process woke it
