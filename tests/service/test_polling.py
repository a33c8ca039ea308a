"""Reads that do not hammer: ETag / If-None-Match → 304, and long polling (?wait= and
Prefer: wait=) woken by the job's change — in-process, and on PostgreSQL from another process
through LISTEN/NOTIFY — on SQLite and PostgreSQL; answers given again only while their rows
read back the same; SQLite read on the event loop, PostgreSQL in batches."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from core.changes import CHANGES
from core.job_rows import ID
from tests.helpers import wait_for
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
    wait_for(lambda: CHANGES.waiting(job["id"]), "the long poll to wait for a change", 30)
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
    wait_for(lambda: CHANGES.waiting(job["id"]), "the long poll to wait for a change", 30)
    script = (
        "import time; from core import jobs; from core.db.session import Database\n"
        f"jobs.request_cancel(Database({held.settings.database!r}), tenant='default', "
        f"job_id={job['id']!r})\nprint(time.time())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                          capture_output=True, text=True)  # fmt: skip
    canceled_at = float(done.stdout.split()[-1])
    poller.join(timeout=30)
    assert answer["status"] == 200 and answer["body"]["status"] == "canceled"
    assert answer["at"] - canceled_at < 5  # NOTIFY from the other process woke it


def test_an_answer_given_again_follows_any_change_to_its_rows(service: Service) -> None:
    """Answers are kept per row read, not per notification: a change nobody announces (a hand
    edit in another connection) shows in the very next read, to the job and to its artifact."""
    job = service.wait(service.submit(layer_swap())["id"])
    url = f"/v1/merges/{job['id']}"
    first = service.client.get(url)
    answers = service.client.app.state.context.answers  # type: ignore[attr-defined]
    assert first.json() == job and len(answers) == 1  # kept: the job has ended, no ETA
    again = service.client.get(url)
    assert again.content == first.content and again.headers["etag"] == first.headers["etag"]

    engine = create_engine(service.settings.database)
    try:
        with engine.begin() as connection:
            connection.execute(
                text("UPDATE jobs SET attempts = attempts + 4 WHERE id = :id"), {"id": job["id"]}
            )
        edited = service.client.get(url, headers={"If-None-Match": first.headers["etag"]})
        assert edited.status_code == 200 and edited.json()["attempts"] == job["attempts"] + 4
        with engine.begin() as connection:
            connection.execute(
                text("UPDATE artifacts SET location = :where WHERE id = :id"),
                {"where": "/moved/elsewhere", "id": job["output"]["artifact_id"]},
            )
        moved = service.client.get(url)
        assert moved.json()["output"]["location"] == "/moved/elsewhere"
        assert moved.headers["etag"] != edited.headers["etag"]
    finally:
        engine.dispose()


def test_a_merge_with_an_evaluation_is_read_anew_each_time(service: Service) -> None:
    """Its view shows another job (its evaluation), which changes without the merge's row:
    such an answer is never kept."""
    merge = service.wait(service.submit(layer_swap())["id"])
    other = service.wait(service.submit(layer_swap())["id"])  # stands in for its evaluation
    url = f"/v1/merges/{merge['id']}"
    engine = create_engine(service.settings.database)
    try:
        with engine.begin() as connection:
            connection.execute(
                text("UPDATE jobs SET result = :result, status = 'failed' WHERE id = :id"),
                {"result": json.dumps({"evaluation_job_id": other["id"]}), "id": merge["id"]},
            )
            connection.execute(
                text("UPDATE jobs SET status = 'failed' WHERE id = :id"), {"id": other["id"]}
            )
        assert service.client.get(url).json()["result"]["evaluation"]["status"] == "failed"
        with engine.begin() as connection:  # the other job alone changes
            connection.execute(
                text("UPDATE jobs SET status = 'canceled' WHERE id = :id"), {"id": other["id"]}
            )
        assert service.client.get(url).json()["result"]["evaluation"]["status"] == "canceled"
    finally:
        engine.dispose()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_read_waits_on_a_thread_while_sqlite_is_locked(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event loop reads SQLite without waiting; when the database is locked, the read is
    made on a thread, which waits for the lock (and the loop serves others meanwhile)."""
    job = service.wait(service.submit(layer_swap())["id"])
    context = service.client.app.state.context  # type: ignore[attr-defined]
    on_thread = threading.Event()
    read_waiting = context.rows._read_waiting

    def announced(job_id: str) -> Any:
        on_thread.set()
        return read_waiting(job_id)

    monkeypatch.setattr(context.rows, "_read_waiting", announced)
    # Exclusive locking in WAL mode: no other connection may be open when it is taken (the
    # app's reopen as they are next used), and no one reads until the holder closes.
    context.rows.dispose()
    service.db.engine.dispose()
    context.db.engine.dispose()
    holder = sqlite3.connect(
        service.settings.database.removeprefix("sqlite:///"),
        timeout=10,
        isolation_level=None,
        check_same_thread=False,
    )
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    released = threading.Event()

    def release() -> None:
        released.set()
        holder.close()

    # held until the checks below are done; released after 60 s only should the loop block
    # (then the test fails instead of waiting for ever)
    deadline = threading.Timer(60, release)
    deadline.start()
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(service.client.get, f"/v1/merges/{job['id']}")
        try:
            assert on_thread.wait(30), "the locked read never went to a thread"
            assert service.client.get("/healthz").status_code == 200
            assert not released.is_set(), "the loop answered only once the lock was released"
            assert not reading.done(), "the read did not wait for the lock"
        finally:
            deadline.cancel()
            if not released.is_set():
                release()
        read = reading.result(timeout=60)
    assert read.status_code == 200 and read.json() == job


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_reads_asked_for_together_are_one_select_with_each_its_own_row(
    held: Service,
) -> None:
    ids = [held.submit(layer_swap())["id"] for _ in range(12)]
    unknown = "f" * 32
    rows = held.client.app.state.context.rows  # type: ignore[attr-defined]

    async def read_all() -> list[Any]:
        together = await asyncio.gather(*(rows.read(i) for i in [*ids, unknown, *ids]))
        one_by_one = [await asyncio.wait_for(rows.read(i), 30) for i in ids[:3]]
        return [*together, *one_by_one]  # each alone after the batches ended: a batch each

    before = rows.selects
    found = held.client.portal.call(read_all)  # type: ignore[union-attr]
    assert [r[ID] if r is not None else None for r in found] == [*ids, None, *ids, *ids[:3]]
    assert 1 + 3 <= rows.selects - before <= 2 + 3  # BATCHES_OUT: the first alone, the rest
    # and through the API, concurrently, each poller gets its own job
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: held.client.get(f"/v1/merges/{i}"), [*ids, unknown]))
    assert [a.json()["id"] for a in answers[:-1]] == ids and answers[-1].status_code == 404


def test_a_poll_with_a_query_is_validated_as_before(service: Service) -> None:
    """A poll without a query string is answered without FastAPI's parameter solving
    (service/api/lean.py); one with a query still goes through it."""
    job = service.wait(service.submit(layer_swap())["id"])
    plain = service.client.get(f"/v1/merges/{job['id']}")
    solved = service.client.get(f"/v1/merges/{job['id']}?unknown=1")
    assert plain.json() == solved.json() == job
    assert plain.headers["etag"] == solved.headers["etag"]
    for wait in ("-1", "61", "x"):
        refused = service.client.get(f"/v1/merges/{job['id']}?wait={wait}")
        assert refused.status_code == 422, (wait, refused.text)
        assert refused.json()["error"]["details"]["field"] == "wait", refused.text
    assert service.client.get(f"/v1/merges/{'0' * 32}").status_code == 404
