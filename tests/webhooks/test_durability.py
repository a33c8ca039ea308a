"""No event is lost when the process that should deliver it dies: `layerswap serve` processes
(SIGKILLed) over one PostgreSQL database, a receiver that verifies every request."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.distributed.conftest import free_port
from tests.service.conftest import layer_swap, postgres_database
from tests.webhooks.receiver import Receiver, Reply, wait_for


@contextmanager
def serving(tmp_path: Path, url: str, log: Path, **env: str) -> Iterator[httpx.Client]:
    """`layerswap serve` (in-process executor) in its own process; killed with SIGKILL."""
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    environment.update({
        "LAYERSWAP_DATA_DIR": str(tmp_path / "data"), "LAYERSWAP_DATABASE_URL": url,
        "LAYERSWAP_PORT": str(port), "LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS": '["127.0.0.0/8"]',
        "LAYERSWAP_WEBHOOK_INTERVAL_S": "0.05", "LAYERSWAP_WEBHOOK_TIMEOUT_S": "1",
        "LAYERSWAP_RECONCILE_INTERVAL_S": "0.2", **env,
    })  # fmt: skip
    layerswap = Path(sys.executable).parent / "layerswap"
    with log.open("a") as out:
        process = subprocess.Popen([str(layerswap), "serve"], env=environment, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        wait_for(lambda: _up(client) or process.poll() is not None, "the API", timeout=120)
        assert process.poll() is None, log.read_text()
        yield client
    finally:
        client.close()
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)


def _up(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def finished(client: httpx.Client, job_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job = client.get(f"/v1/merges/{job_id}").json()
        return dict(job) if job["status"] in ("succeeded", "failed", "canceled") else None

    return dict(wait_for(done, "the merge", timeout=120))


def test_an_event_outlives_the_process_that_should_have_sent_it(
    tmp_path: Path, examples: Path
) -> None:
    checkpoints = tmp_path / "data" / "checkpoints"
    for name in ("base", "math", "swh"):
        shutil.copytree(examples / name, checkpoints / name)
    receiver = Receiver().start()
    log = tmp_path / "serve.log"
    try:
        with postgres_database() as url:
            # 1. The state change commits its event, and the process dies before any send (its
            #    delivery loop is too slow to run first).
            with serving(tmp_path, url, log, LAYERSWAP_WEBHOOK_INTERVAL_S="3600") as api:
                endpoint = api.post("/v1/webhooks", json={"url": receiver.url}).json()
                receiver.secrets.append(endpoint["secret"])
                first = finished(api, api.post("/v1/merges", json=layer_swap()).json()["id"])
                assert first["status"] == "succeeded"
            assert receiver.received == []

            # 2. The next process delivers it; this one is killed while the receiver holds the
            #    request open (sent, never answered).
            held = threading.Event()
            receiver.script = [Reply(200, hold=held)]
            with serving(tmp_path, url, log) as api:
                receiver.wait_for(lambda: receiver.script == [], "the first send")
            held.set()  # the receiver answers into a dead connection

            # 3. Another process sends it again once the dead one's claim lapses.
            with serving(tmp_path, url, log) as api:
                listing = f"/v1/webhooks/{endpoint['id']}/deliveries"
                (delivery,) = receiver.wait_for(
                    lambda: [
                        d for d in api.get(listing).json()["items"] if d["status"] == "delivered"
                    ],
                    "the delivery",
                    timeout=60,
                )
        received = receiver.of_type("merge.succeeded")
        assert len(received) == 2  # at least once: the held send and the repeat
        assert {r.webhook_id for r in received} == {delivery["webhook_id"]}  # one id to dedupe
        assert all(r.verified is not None for r in received)
        assert json.loads(received[-1].body)["data"]["id"] == first["id"]
        assert delivery["attempts"][-1]["status_code"] == 200
        assert delivery["attempts"][-1]["attempt"] == 2  # the killed attempt counted
    finally:
        receiver.stop()
