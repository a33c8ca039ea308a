"""Webhooks end to end with the real service, a real receiver verifying signatures with the
standardwebhooks library, on SQLite and PostgreSQL: thin signed events filtered per endpoint,
one-off URLs, retries (receiver down, 5xx, Retry-After, redirects not followed), 410 disabling,
replay, SSRF refusals at creation and at connect time, and tenants kept apart."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from service.auth import create_key
from tests.service.conftest import Service, layer_swap, running_service
from tests.webhooks.conftest import FAST, subscribe
from tests.webhooks.receiver import Receiver, Reply, wait_for


def deliveries(service: Service, endpoint_id: str, **headers: str) -> list[dict[str, Any]]:
    response = service.client.get(f"/v1/webhooks/{endpoint_id}/deliveries", headers=headers)
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def ended(service: Service, endpoint_id: str, count: int = 1) -> list[dict[str, Any]]:
    """The endpoint's deliveries once `count` of them have ended (delivered or failed)."""
    return list(
        wait_for(
            lambda: (
                (found := deliveries(service, endpoint_id))
                and sum(d["status"] != "pending" for d in found) >= count
                and found
            ),
            f"{count} ended deliveries",
        )
    )


def test_merge_events_are_signed_thin_and_filtered(service: Service, receiver: Receiver) -> None:
    everything = subscribe(service, receiver, description="all events")
    assert everything["secret"].startswith("whsec_")
    assert everything["events"][0] == "merge.succeeded" and len(everything["events"]) == 7
    only_failures = service.client.post(
        "/v1/webhooks", json={"url": receiver.url + "/failures", "events": ["merge.failed"]}
    ).json()
    shown = service.client.get(f"/v1/webhooks/{everything['id']}").json()
    assert "secret" not in shown and shown["status"] == "enabled"
    assert [e["id"] for e in service.client.get("/v1/webhooks").json()["items"]] == [
        everything["id"], only_failures["id"]
    ]  # fmt: skip

    job = service.wait(service.submit(layer_swap())["id"])
    assert job["status"] == "succeeded"
    (received,) = receiver.wait_for(lambda: receiver.of_type("merge.succeeded"), "merge event")
    payload = received.verified
    assert payload is not None, "the signature did not verify with the endpoint's secret"
    assert payload["type"] == "merge.succeeded"
    data = payload["data"]
    assert (data["id"], data["status"], data["object"]) == (job["id"], "succeeded", "merge")
    assert data["artifact_id"] == job["output"]["artifact_id"]
    assert data["links"] == {
        "self": f"https://layerswap.example/v1/merges/{job['id']}",
        "artifact": f"https://layerswap.example/v1/artifacts/{data['artifact_id']}",
    }
    assert datetime.fromisoformat(payload["timestamp"]).tzinfo is not None
    assert int(received.headers["webhook-timestamp"]) > 0
    assert received.path == "/hooks"  # nothing for the endpoint that wants failures only

    (delivery,) = ended(service, everything["id"])
    assert delivery["status"] == "delivered" and delivery["webhook_id"] == received.webhook_id
    assert [a["status_code"] for a in delivery["attempts"]] == [200]
    assert delivery["subject_id"] == job["id"] and delivery["payload"]["type"] == "merge.succeeded"
    assert deliveries(service, only_failures["id"]) == []

    # A rotated secret signs from then on; rotated with no overlap (a leaked secret, say), the
    # old one no longer verifies (test_secrets.py: the overlap).
    rotated = service.client.post(
        f"/v1/webhooks/{everything['id']}/rotate-secret", json={"overlap_s": 0}
    ).json()
    assert rotated["previous_secret_expires_at"] is None
    assert rotated["secret"] != everything["secret"]
    receiver.secrets = [everything["secret"]]
    service.wait(service.submit(layer_swap(), **{"Idempotency-Key": "second"})["id"])
    second = receiver.wait_for(lambda: receiver.of_type("merge.succeeded")[1:], "second event")
    assert second[0].verified is None
    receiver.secrets = [rotated["secret"]]
    assert receiver._verify(second[0].body, second[0].headers) is not None

    # Deleted: no more deliveries, and it is gone from the list.
    assert service.client.delete(f"/v1/webhooks/{everything['id']}").status_code == 204
    assert service.client.get(f"/v1/webhooks/{everything['id']}").status_code == 404
    third = service.wait(service.submit(layer_swap(), **{"Idempotency-Key": "third"})["id"])
    about = service.client.get("/v1/webhooks/deliveries", params={"subject_id": third["id"]})
    assert about.json()["items"] == []


def test_a_merges_one_off_webhook_is_signed_with_the_tenant_secret(
    service: Service, receiver: Receiver
) -> None:
    secret = service.client.get("/v1/webhooks/secret").json()["secret"]
    assert secret == service.client.get("/v1/webhooks/secret").json()["secret"]  # made once
    receiver.secrets.append(secret)
    job = service.wait(service.submit({**layer_swap(), "webhook": receiver.url + "/once"})["id"])
    assert job["request"]["webhook"] == receiver.url + "/once"
    (received,) = receiver.wait_for(lambda: receiver.of_type("merge.succeeded"), "one-off event")
    assert received.path == "/hooks/once"
    assert received.verified is not None and received.verified["data"]["id"] == job["id"]
    listed = service.client.get("/v1/webhooks/deliveries", params={"subject_id": job["id"]})
    (delivery,) = listed.json()["items"]
    assert delivery["endpoint_id"] is None and delivery["url"] == receiver.url + "/once"

    refused = service.client.post(
        "/v1/merges", json={**layer_swap(), "webhook": "http://10.1.2.3/x"}
    )
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["details"]["field"] == "webhook"
    assert len(service.client.get("/v1/merges").json()["items"]) == 1


def test_a_failing_receiver_is_retried_until_it_answers(
    service: Service, receiver: Receiver
) -> None:
    endpoint = subscribe(service, receiver)
    receiver.stop()  # down: connections refused
    job = service.wait(service.submit(layer_swap())["id"])
    receiver.wait_for(
        lambda: sum(len(d["attempts"]) for d in deliveries(service, endpoint["id"])) >= 2,
        "two refused attempts",
    )
    moved = receiver.url + "/moved"
    receiver.script = [
        Reply(302, {"Location": moved}),
        Reply(500),
        Reply(503, {"Retry-After": "1"}),
    ]
    receiver.start()
    (delivery,) = receiver.wait_for(
        lambda: [d for d in deliveries(service, endpoint["id"]) if d["status"] == "delivered"],
        "delivery after the receiver came back",
        timeout=90,
    )
    codes = [a["status_code"] for a in delivery["attempts"]]
    assert codes[-4:] == [302, 500, 503, 200] and set(codes[:-4]) == {None}
    assert all("Connect" in a["error"] for a in delivery["attempts"][:-4])
    assert "redirects are not followed" in delivery["attempts"][-4]["error"]
    assert delivery["attempts"][-2]["retry_after_s"] == 1.0
    after_503 = datetime.fromisoformat(delivery["attempts"][-1]["at"]) - datetime.fromisoformat(
        delivery["attempts"][-2]["at"]
    )
    assert after_503.total_seconds() >= 1.0  # Retry-After honoured
    received = receiver.of_type("merge.succeeded")
    assert [r.answered for r in received] == [302, 500, 503, 200]
    assert {r.webhook_id for r in received} == {delivery["webhook_id"]}  # one id across retries
    assert all(r.path == "/hooks" for r in received)  # the redirect was not followed
    assert received[-1].verified is not None and received[-1].verified["data"]["id"] == job["id"]


def test_410_disables_the_endpoint_and_a_replay_sends_again(
    service: Service, receiver: Receiver
) -> None:
    endpoint = subscribe(service, receiver)
    receiver.script = [Reply(410)]
    service.wait(service.submit(layer_swap())["id"])
    (failed,) = ended(service, endpoint["id"])
    assert failed["status"] == "failed" and "410" in failed["last_error"]
    shown = service.client.get(f"/v1/webhooks/{endpoint['id']}").json()
    assert shown["status"] == "disabled" and "410" in shown["disabled_reason"]

    service.wait(service.submit(layer_swap(), **{"Idempotency-Key": "2"})["id"])
    assert len(deliveries(service, endpoint["id"])) == 1  # a disabled endpoint gets nothing

    replay = f"/v1/webhooks/deliveries/{failed['id']}/replay"
    assert service.client.post(replay).status_code == 409  # disabled: enable first
    assert (
        service.client.post(f"/v1/webhooks/{endpoint['id']}/enable").json()["status"] == "enabled"
    )
    assert service.client.post(replay).status_code == 202
    (delivered,) = receiver.wait_for(
        lambda: [d for d in deliveries(service, endpoint["id"]) if d["status"] == "delivered"],
        "the replay",
    )
    assert [a["status_code"] for a in delivered["attempts"]] == [410, 200]
    first, again = receiver.of_type("merge.succeeded")
    assert first.webhook_id == again.webhook_id == failed["webhook_id"]
    held = threading.Event()  # the replay's request stays open: the delivery stays pending
    receiver.script = [Reply(200, hold=held)]
    assert service.client.post(replay).status_code == 202  # an ended delivery can be replayed
    try:
        assert service.client.post(replay).status_code == 409  # ...but not while pending
    finally:
        held.set()
    receiver.wait_for(
        lambda: len(receiver.of_type("merge.succeeded")) == 3, "the replay, let through"
    )


UNSAFE = [
    ("ftp://example.com/hook", "only http and https"),
    ("http://127.0.0.1:9/hook", "loopback"),
    ("http://localhost/hook", "loopback"),
    ("http://[::1]/hook", "loopback"),
    ("http://10.1.2.3/hook", "private"),
    ("http://192.168.0.10/hook", "private"),
    ("http://169.254.169.254/latest/meta-data", "metadata"),
    ("http://user:secret@example.com/hook", "credentials"),
    ("http://no-such-host.invalid/hook", "does not resolve"),
    ("not a url", "only http and https"),
]


def test_unsafe_urls_are_refused_at_creation_and_at_connect_time(
    tmp_path: Path, database_url: str, examples: Path, receiver: Receiver
) -> None:
    timings = {k: v for k, v in FAST.items() if k != "webhook_allowed_networks"}
    with running_service(tmp_path, database_url, examples, **FAST) as allowed:
        endpoint = subscribe(allowed, receiver)  # loopback allowed by this operator
    with running_service(tmp_path, database_url, examples, **timings) as strict:
        for url, why in UNSAFE:
            response = strict.client.post("/v1/webhooks", json={"url": url})
            assert response.status_code == 422, (url, response.text)
            error = response.json()["error"]
            assert why in error["message"] and error["details"]["field"] == "url", (url, error)
            merge = strict.client.post("/v1/merges", json={**layer_swap(), "webhook": url})
            assert merge.status_code == 422 and "webhook" in merge.text, (url, merge.text)
        assert len(strict.client.get("/v1/webhooks").json()["items"]) == 1  # the earlier one
        assert strict.client.get("/v1/merges").json()["items"] == []

        # The endpoint made while loopback was allowed is checked again at each connect.
        strict.wait(strict.submit(layer_swap())["id"])
        found = receiver.wait_for(
            lambda: [d for d in deliveries(strict, endpoint["id"]) if len(d["attempts"]) >= 2],
            "refused attempts",
        )
        assert all(a["error"].startswith("refused:") for a in found[0]["attempts"])
        assert receiver.received == []


def test_tenants_never_receive_each_others_events(
    tmp_path: Path, database_url: str, examples: Path, receiver: Receiver
) -> None:
    with running_service(tmp_path, database_url, examples, auth=True, **FAST) as service:
        keys = {t: {"Authorization": f"Bearer {create_key(service.db, t)}"} for t in "ab"}
        endpoints, jobs = {}, {}
        for tenant, headers in keys.items():
            created = service.client.post(
                "/v1/webhooks", json={"url": f"{receiver.url}/{tenant}"}, headers=headers
            ).json()
            receiver.secrets.append(created["secret"])
            endpoints[tenant] = created["id"]
            job = service.submit(layer_swap(), **headers)
            jobs[tenant] = job["id"]
        for tenant, headers in keys.items():
            other = "b" if tenant == "a" else "a"
            assert (
                service.client.get(f"/v1/webhooks/{endpoints[other]}", headers=headers).status_code
                == 404
            )
            assert (
                service.client.get(
                    f"/v1/webhooks/{endpoints[other]}/deliveries", headers=headers
                ).status_code
                == 404
            )
            listed = service.client.get("/v1/webhooks", headers=headers).json()["items"]
            assert [e["id"] for e in listed] == [endpoints[tenant]]
        receiver.wait_for(lambda: len(receiver.of_type("merge.succeeded")) == 2, "both events")
        for received in receiver.of_type("merge.succeeded"):
            tenant = received.path.rsplit("/", 1)[-1]
            assert json.loads(received.body)["data"]["id"] == jobs[tenant]
            assert received.verified is not None
        secret_a = service.client.get("/v1/webhooks/secret", headers=keys["a"]).json()["secret"]
        secret_b = service.client.get("/v1/webhooks/secret", headers=keys["b"]).json()["secret"]
        assert secret_a != secret_b


def test_unknown_event_types_and_ids_are_clear_errors(service: Service) -> None:
    response = service.client.post(
        "/v1/webhooks", json={"url": "https://example.com/h", "events": ["merge.exploded"]}
    )
    assert response.status_code == 422 and "events" in response.text
    response = service.client.post(
        "/v1/webhooks", json={"url": "https://example.com/h", "events": []}
    )
    assert response.status_code == 422
    assert service.client.get("/v1/webhooks/nope").status_code == 404
    assert service.client.post("/v1/webhooks/deliveries/nope/replay").status_code == 404
    # An id with a NUL byte names nothing (PostgreSQL would refuse it in a query: not a 500).
    assert service.client.get("/v1/webhooks/a%00b").status_code == 404
    assert service.client.post("/v1/webhooks/deliveries/a%00b/replay").status_code == 404
    assert service.client.get("/v1/sweeps/a%00b").status_code == 404
    # ... and one in a query parameter is refused naming it, on every store alike.
    listed = service.client.get("/v1/webhooks/deliveries", params={"subject_id": "a\x00b"})
    assert listed.status_code == 422
    assert listed.json()["error"]["details"] == {"field": "subject_id", "in": "query"}
