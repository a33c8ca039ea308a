"""Server-Sent Events over real HTTP (uvicorn): a stream ends by itself after its lifetime, and a
tenant holds at most N streams at once in one API process, a slot freeing when a client hangs up."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from service.auth import create_key
from tests.helpers import wait_for
from tests.service.conftest import layer_swap
from tests.service.live import Live, live_service
from tests.service.test_api_lifecycle import HeldExecutor

SSE = {"Accept": "text/event-stream"}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'layerswap.db'}"


def submit(live: Live, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{live.url}/v1/merges", json=layer_swap(), headers=headers, timeout=30)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def read_stream(live: Live, job_id: str, **headers: str) -> list[str]:
    """Every line of one stream, up to its end (the server's: the read would time out)."""
    url = f"{live.url}/v1/merges/{job_id}/events"
    with httpx.stream("GET", url, headers={**SSE, **headers}, timeout=30) as response:
        assert response.status_code == 200, response.read()
        return list(response.iter_lines())


def test_a_stream_ends_by_itself_after_its_lifetime(
    tmp_path: Path, sqlite_url: str, examples: Path
) -> None:
    """The job stays queued forever (nothing runs it); the stream still ends, and the client
    resumes where it was with Last-Event-ID."""
    with live_service(
        tmp_path, sqlite_url, examples, job_executor=HeldExecutor(), sse_max_seconds=0.3
    ) as live:
        job_id = submit(live)
        lines = read_stream(live, job_id)
        hint = [line for line in lines if line][-1]  # the last field: come back soon
        assert hint.startswith("retry: ") and int(hint.split()[1]) > 0
        ids = [line.removeprefix("id: ") for line in lines if line.startswith("id: ")]
        assert "event: queued" in lines and len(ids) == 1

        resumed = read_stream(live, job_id, **{"Last-Event-ID": ids[0]})
        assert [line for line in resumed if line] == [hint]  # nothing sent twice
        job = httpx.get(f"{live.url}/v1/merges/{job_id}", timeout=30).json()
        assert job["status"] == "queued"  # it ended by its lifetime, not with the job
        slots = live.app.state.context.streams
        wait_for(lambda: slots.held("default") == 0, "the ended stream's slot to be freed", 30)


def open_stream(stack: ExitStack, live: Live, job_id: str, key: str) -> httpx.Response:
    client = stack.enter_context(httpx.Client(timeout=30))
    headers = {**SSE, "Authorization": f"Bearer {key}"}
    request = client.build_request("GET", f"{live.url}/v1/merges/{job_id}/events", headers=headers)
    return client.send(request, stream=True)


def test_a_tenant_holds_at_most_n_streams(tmp_path: Path, sqlite_url: str, examples: Path) -> None:
    with live_service(
        tmp_path, sqlite_url, examples, job_executor=HeldExecutor(), auth=True,
        sse_streams_per_tenant=2,
    ) as live, ExitStack() as stack:  # fmt: skip
        db = live.app.state.context.db
        slots = live.app.state.context.streams
        key_a, key_b = create_key(db, "team-a"), create_key(db, "team-b")
        job_a, job_b = submit(live, key_a), submit(live, key_b)

        first = open_stream(stack, live, job_a, key_a)
        second = open_stream(stack, live, job_a, key_a)
        assert first.status_code == second.status_code == 200
        third = open_stream(stack, live, job_a, key_a)
        assert third.status_code == 429
        third.read()
        error = third.json()["error"]
        assert error["code"] == "too_many_streams"
        assert int(third.headers["Retry-After"]) > 0
        assert slots.held("team-a") == 2  # the refused one took nothing

        other = open_stream(stack, live, job_b, key_b)  # another tenant has slots of its own
        assert other.status_code == 200

        first.close()  # the client hangs up: its slot comes back
        wait_for(lambda: slots.held("team-a") == 1, "the closed stream's slot to be freed", 30)
        again = open_stream(stack, live, job_a, key_a)
        assert again.status_code == 200
        for response in (second, other, again):
            response.close()
        wait_for(lambda: slots.held("team-a") == slots.held("team-b") == 0, "every slot freed", 30)
