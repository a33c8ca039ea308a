"""Webhooks when jobs run on Celery workers: the worker process writes the event with the
job's end, an API process delivers it (and signs it: workers never need the key that
encrypts the signing secrets)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.distributed.conftest import Cluster
from tests.service.conftest import layer_swap
from tests.webhooks.conftest import FAST, subscribe
from tests.webhooks.receiver import Received, Receiver


@pytest.fixture
def cluster_settings() -> dict[str, Any]:
    return dict(FAST)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver().start()
    yield running
    running.stop()


def test_a_job_that_ends_on_a_worker_is_told_by_the_api(
    cluster: Cluster, receiver: Receiver
) -> None:
    subscribe(cluster.service, receiver, events=["merge.succeeded", "analysis.completed"])
    worker = cluster.start_worker(LAYERSWAP_WEBHOOK_SECRET_KEYS="not-a-key")  # never read
    merge = {**layer_swap(), "webhook": receiver.url + "/once"}
    job = cluster.service.wait(cluster.service.submit(merge)["id"])
    assert job["status"] == "succeeded", job["error"]
    analysis = cluster.service.client.post(
        "/v1/analyses", json={"base": "base", "experts": [{"label": "math", "path": "math"}]}
    ).json()
    cluster.service.wait(analysis["id"], kind="analyses")
    assert f"job {job['id']}: attempt 1 started" in worker.text()  # it ran on the worker

    def both() -> list[Received] | None:
        found = sorted(receiver.of_type("merge.succeeded"), key=lambda r: r.path)
        return found if len(found) == 2 else None

    merged, once = receiver.wait_for(both, "the endpoint's and the one-off URL's events")
    # The one-off URL's, signed with the tenant's secret, made by the API when first needed.
    secret = cluster.service.client.get("/v1/webhooks/secret").json()["secret"]
    assert once.path == "/hooks/once" and receiver._verify(once.body, once.headers) is None
    receiver.secrets.append(secret)
    assert receiver._verify(once.body, once.headers) is not None
    (analysed,) = receiver.wait_for(lambda: receiver.of_type("analysis.completed"), "analysis")
    assert merged.verified is not None and merged.verified["data"]["id"] == job["id"]
    assert analysed.verified is not None and analysed.verified["data"]["id"] == analysis["id"]
    assert analysed.verified["data"]["links"]["self"].endswith(f"/v1/analyses/{analysis['id']}")
