"""Delivery is fair across tenants and every attempt is bounded: one tenant's slow receivers
hold at most its share of the delivery slots, so another tenant's event still goes out at
once; a receiver that never answers, or answers a byte a second, is given up after
`webhook_timeout_s`, recorded as a failed attempt and retried. Real receivers on 127.0.0.1,
two tenants with API keys, SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from service.webhooks.delivery import fair_shares
from tests.service.conftest import Service, running_service
from tests.webhooks.conftest import FAST, announce, tenant_headers
from tests.webhooks.receiver import Receiver, Reply, wait_for
from tests.webhooks.stuck import StuckServer


def subscribe(service: Service, url: str, headers: dict[str, str]) -> dict[str, Any]:
    response = service.client.post("/v1/webhooks", json={"url": url}, headers=headers)
    assert response.status_code == 201, response.text
    return dict(response.json())


def deliveries(service: Service, headers: dict[str, str]) -> list[dict[str, Any]]:
    response = service.client.get("/v1/webhooks/deliveries", headers=headers)
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def seconds(later: str, earlier: str) -> float:
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def test_free_slots_go_to_the_tenants_with_fewest_in_flight() -> None:
    # a, waiting longest, already has 3 in flight: b and c get the slots first, in turn.
    waiting = [("a", 60), ("b", 60), ("c", 1)]
    assert fair_shares(waiting, {"a": 3}, room=4, cap=4) == {"b": 3, "c": 1}
    assert fair_shares(waiting, {"a": 3}, room=8, cap=4) == {"a": 1, "b": 4, "c": 1}
    # never beyond the cap per tenant, nor beyond what is due, nor beyond the room
    assert fair_shares(waiting, {"a": 4, "b": 4}, room=8, cap=4) == {"c": 1}
    assert fair_shares([("a", 2)], {}, room=8, cap=4) == {"a": 2}
    assert fair_shares(waiting, {}, room=2, cap=4) == {"a": 1, "b": 1}
    assert fair_shares(waiting, {}, room=0, cap=4) == {}


@pytest.fixture
def slow() -> Iterator[tuple[Receiver, threading.Event]]:
    """A receiver that holds every request open until the test lets go."""
    held = threading.Event()
    running = Receiver().start()
    running.script = [Reply(200, hold=held) for _ in range(100)]
    yield running, held
    held.set()
    running.stop()


def test_one_tenants_slow_receivers_do_not_delay_another_tenants_delivery(
    tmp_path: Path,
    database_url: str,
    examples: Path,
    receiver: Receiver,
    slow: tuple[Receiver, threading.Event],
) -> None:
    held_receiver, held = slow
    settings = {**FAST, "webhook_timeout_s": 30.0, "webhook_concurrency": 8,
                "webhook_tenant_concurrency": 3}  # fmt: skip
    with running_service(tmp_path, database_url, examples, auth=True, **settings) as service:
        headers = tenant_headers(service, "a", "b")
        for i in range(10):
            subscribe(service, f"{held_receiver.url}/{i}", headers["a"])
        announce(service.db, "a")
        # Tenant a's ten deliveries: three in flight (its share), all held by its receiver.
        wait_for(lambda: held_receiver.open == 3, "tenant a's share in flight")

        receiver.secrets.append(subscribe(service, receiver.url, headers["b"])["secret"])
        job_id = announce(service.db, "b")
        (arrived,) = receiver.wait_for(lambda: receiver.of_type("merge.succeeded"), "b's event")
        assert arrived.verified is not None and arrived.verified["data"]["id"] == job_id

        # ...while every one of tenant a's is still pending, no more than its share ever sent.
        assert held_receiver.open == 3 and held_receiver.most_open == 3
        waiting = deliveries(service, headers["a"])
        assert len(waiting) == 10
        assert all(d["status"] == "pending" and d["attempts"] == [] for d in waiting)
        (delivered,) = wait_for(
            lambda: [d for d in deliveries(service, headers["b"]) if d["status"] == "delivered"],
            "b's delivery recorded",
        )
        assert seconds(delivered["attempts"][0]["at"], delivered["created_at"]) < 5.0
        held.set()


@pytest.fixture
def stuck() -> Iterator[tuple[StuckServer, StuckServer]]:
    silent, drip = StuckServer("silent").start(), StuckServer("drip").start()
    yield silent, drip
    silent.stop()
    drip.stop()


def test_receivers_that_never_finish_answering_are_given_up_after_the_bound(
    tmp_path: Path,
    database_url: str,
    examples: Path,
    receiver: Receiver,
    stuck: tuple[StuckServer, StuckServer],
) -> None:
    silent, drip = stuck
    bound = 3.0
    settings = {**FAST, "webhook_timeout_s": bound}
    with running_service(tmp_path, database_url, examples, auth=True, **settings) as service:
        headers = tenant_headers(service, "a", "b")
        ids = [subscribe(service, s.url, headers["a"])["id"] for s in stuck]
        for tenant in ("a", "b"):
            receiver.secrets.append(subscribe(service, receiver.url, headers[tenant])["secret"])
        for tenant in ("a", "b"):
            announce(service.db, tenant)

        def retried() -> list[dict[str, Any]] | None:
            found = {d["endpoint_id"]: d for d in deliveries(service, headers["a"])}
            tried = [found[i] for i in ids if i in found and len(found[i]["attempts"]) >= 2]
            return tried if len(tried) == len(ids) else None

        given_up = wait_for(retried, "two bounded attempts at each stuck receiver", timeout=60)
        for delivery in given_up:
            assert delivery["status"] == "pending"  # retried per the policy, not abandoned
            for attempt in delivery["attempts"]:
                assert attempt["status_code"] is None and "timed out" in attempt["error"]
                assert bound * 1000 <= attempt["duration_ms"] < (bound + 3) * 1000, attempt
        assert silent.accepted >= 2 and drip.accepted >= 2  # each attempt reached them

        # The other deliveries, of both tenants, went out before the first stuck attempt ended.
        first_given_up = min(d["attempts"][0]["at"] for d in given_up)
        for tenant in ("a", "b"):
            (good,) = [d for d in deliveries(service, headers[tenant]) if d["url"] == receiver.url]
            assert good["status"] == "delivered", good
            assert seconds(first_given_up, good["attempts"][0]["at"]) > 0
        assert len(receiver.of_type("merge.succeeded")) == 2
