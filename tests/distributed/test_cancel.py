"""Cancel on Celery workers (another process: the database's cancel flag is all they see): a
cancel accepted while the worker publishes ends the job `canceled` with nothing left behind,
and one that comes after the job succeeded answers 409 and changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from core.db.models import Artifact, LineageEdge
from tests.distributed.conftest import HUB_TOKEN, Cluster, leftovers, outputs, wait_for
from tests.service.conftest import layer_swap

pytestmark = pytest.mark.timeout(300)


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in ("succeeded", "failed", "canceled")


def rows(cluster: Cluster, model: Any) -> int:
    with cluster.service.db.session() as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def test_a_cancel_accepted_while_a_worker_publishes_ends_canceled_with_nothing_left(
    cluster: Cluster, hub: Any
) -> None:
    """The Hub holds the worker's first upload: the output is in place and being published,
    its commit not made. The cancel is accepted; once the upload ends the worker stops before
    the commit and removes the output. Then a merge of the same name succeeds, and canceling
    it answers 409."""
    hub.add_token(HUB_TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    held = hub.hold_upload()
    worker = cluster.start_worker()
    hub_output = {"repo": "team-a/held", "credential": "team-a"}
    body = {**layer_swap(), "output": {"name": "held", "hub": hub_output}}
    job = cluster.service.submit(body)
    wait_for(held.reached.is_set, "the worker's first upload to reach the Hub", timeout=120)
    assert cluster.job(job["id"])["stage"] == "publishing"
    answer = cluster.service.client.post(f"/v1/merges/{job['id']}/cancel")
    assert answer.status_code == 202, answer.text
    assert answer.json()["status"] == "canceling"
    held.release()

    done = cluster.wait_until(job["id"], finished)
    assert done["status"] == "canceled" and done["output"] is None, done
    assert cluster.event_types(job["id"])[-2:] == ["canceling", "canceled"]
    assert outputs(cluster.service) == [] and leftovers(cluster.service) == []
    assert rows(cluster, Artifact) == 0 and rows(cluster, LineageEdge) == 0
    assert not any(job["id"] in commit.title for commit in hub.commits("team-a/held"))

    again = cluster.service.submit({**layer_swap(), "output": {"name": "held"}})
    succeeded = cluster.wait_until(again["id"], finished)
    assert succeeded["status"] == "succeeded", succeeded
    late = cluster.service.client.post(f"/v1/merges/{again['id']}/cancel")
    assert late.status_code == 409, late.text
    assert late.json()["error"]["details"] == {"status": "succeeded"}
    assert cluster.job(again["id"])["output"] == succeeded["output"]
    assert cluster.event_types(again["id"])[-1] == "succeeded"
    assert outputs(cluster.service) == ["held"]
    assert worker.process.poll() is None
