"""The Python client against the real service over HTTP (uvicorn on a loopback port): create,
wait, events (SSE), auto-paginating lists, lineage, typed errors, the async client, retries
that never make a second job, and webhook verification."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from layerswap_client import (
    AsyncClient,
    Client,
    LayerswapError,
    WebhookVerificationError,
    verify_webhook,
)
from tests.service.conftest import layer_swap
from tests.service.live import Live, live_service
from tests.webhooks.conftest import FAST
from tests.webhooks.receiver import Receiver


@pytest.fixture
def live(tmp_path: Path, examples: Path) -> Iterator[Live]:
    with live_service(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples, **FAST) as running:
        yield running


def test_create_wait_events_list_and_lineage(live: Live) -> None:
    with Client(live.url) as client:
        job = client.merges.create(layer_swap())
        assert job.status in ("queued", "running") and job.kind == "merge"
        events = list(client.merges.events(job.id))
        assert events[-1].type == "succeeded"
        assert [e.id for e in events] == sorted({e.id for e in events})  # each once, in order
        assert "running" in [e.type for e in events]
        done = client.merges.wait(job.id)
        assert done.status == "succeeded" and done.output is not None
        assert events[-1].data["artifact_id"] == done.output.artifact_id

        more = [client.merges.create(layer_swap(bottom=2)).id for _ in range(3)]
        listed = [j.id for j in client.merges.list(page_size=2)]  # two pages and a bit
        assert sorted(listed) == sorted([job.id, *more])

        graph = client.artifacts.lineage(done.output.artifact_id)
        roles = {e["role"] for j in graph["jobs"] for e in j["inputs"]}
        assert {"task", "language"} <= roles
        artifact = client.artifacts.get(done.output.artifact_id)
        assert artifact.location == done.output.location

        with pytest.raises(LayerswapError) as refused:
            client.merges.create({**layer_swap(), "params": {"bottom": -1, "top": 1}})
        assert refused.value.status == 422 and refused.value.code
        with pytest.raises(LayerswapError) as missing:
            client.merges.get("0" * 32)
        assert (missing.value.status, missing.value.code) == (404, "not_found")
        with pytest.raises(LayerswapError) as ended:
            client.merges.cancel(job.id)
        assert ended.value.status == 409 and ended.value.details["status"] == "succeeded"


def test_the_async_client(live: Live) -> None:
    async def flow() -> tuple[str, list[str], str, list[str]]:
        async with AsyncClient(live.url) as client:
            job = await client.merges.create(layer_swap())
            types = [e.type async for e in client.merges.events(job.id)]
            done = await client.merges.wait(job.id)
            listed = [j.id async for j in client.merges.list(page_size=1)]
            return job.id, types, done.status, listed

    job_id, types, status, listed = asyncio.run(flow())
    assert types[-1] == "succeeded" and status == "succeeded" and listed == [job_id]


class DropsFirstResponse(httpx.BaseTransport):
    """The network between client and service: the first POST reaches the service and is
    answered, but the answer is lost on the way back."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.keys: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.method == "POST":
            self.keys.append(request.headers.get("idempotency-key"))
            if len(self.keys) == 1:
                response.read()
                raise httpx.ReadError("connection reset by peer", request=request)
        return response


def test_a_retry_after_a_dropped_response_makes_no_second_job(live: Live) -> None:
    network = DropsFirstResponse()
    with Client(live.url, transport=network) as client:
        job = client.merges.create(layer_swap())
        assert len(network.keys) == 2 and network.keys[0] == network.keys[1] is not None
        assert [j.id for j in client.merges.list()] == [job.id]  # the service made one
        assert client.merges.wait(job.id).status == "succeeded"


class BusyFirst(httpx.BaseTransport):
    """A service that first answers 503 with Retry-After, then 429, then serves."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[float, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        busy = {0: (503, {"Retry-After": "1"}), 1: (429, {"Retry-After": "0"})}.get(len(self.seen))
        if busy is not None:
            self.seen.append((time.monotonic(), busy[0]))
            body = {"error": {"code": "busy", "message": "try later", "details": {}}}
            return httpx.Response(busy[0], headers=busy[1], json=body, request=request)
        response = self.inner.handle_request(request)
        self.seen.append((time.monotonic(), response.status_code))
        return response


def test_429_and_503_are_retried_honouring_retry_after(live: Live) -> None:
    network = BusyFirst()
    with Client(live.url, transport=network) as client:
        job = client.merges.create(layer_swap())
    assert [status for _, status in network.seen] == [503, 429, 202]
    assert network.seen[1][0] - network.seen[0][0] >= 1.0  # waited as told
    with (
        Client(live.url, transport=BusyFirst(), max_retries=0) as client,
        pytest.raises(LayerswapError) as gave_up,
    ):
        client.merges.get(job.id)
    assert gave_up.value.status == 503


def test_webhooks_through_the_client_verify_with_its_helper(live: Live) -> None:
    receiver = Receiver().start()
    try:
        with Client(live.url) as client:
            endpoint = client.webhooks.create(receiver.url, events=["merge.succeeded"])
            assert endpoint.secret is not None and [e.id for e in client.webhooks.list()] == [
                endpoint.id
            ]
            job = client.merges.wait(client.merges.create(layer_swap()).id)
            (received,) = receiver.wait_for(
                lambda: receiver.of_type("merge.succeeded"), "the event"
            )
            event: dict[str, Any] = verify_webhook(endpoint.secret, received.body, received.headers)
            assert event["data"]["id"] == job.id
            with pytest.raises(WebhookVerificationError):
                verify_webhook(endpoint.secret, received.body + b" ", received.headers)
            (delivery,) = receiver.wait_for(
                lambda: [
                    d for d in client.webhooks.deliveries(endpoint.id) if d.status != "pending"
                ],
                "the delivery record",
            )
            assert delivery.status == "delivered" and delivery.webhook_id == received.webhook_id
    finally:
        receiver.stop()


def test_webhook_lists_follow_pages_and_rotation_keeps_the_old_secret(live: Live) -> None:
    receiver = Receiver().start()  # never called: no event is subscribed to
    with Client(live.url) as client:
        created = [
            client.webhooks.create(f"{receiver.url}/{i}", events=["sweep.completed"])
            for i in range(3)
        ]
        listed = client.webhooks.list(page_size=2)  # two pages
        assert [e.id for e in listed] == [e.id for e in created]
        rotated = client.webhooks.rotate_secret(created[0].id, overlap_s=600)
        assert rotated.secret not in (None, created[0].secret)
        assert rotated.previous_secret_expires_at is not None
        immediate = client.webhooks.rotate_secret(created[1].id, overlap_s=0)
        assert immediate.previous_secret_expires_at is None
    receiver.stop()
