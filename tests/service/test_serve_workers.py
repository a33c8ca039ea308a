"""`layerswap serve --workers N`: several API processes on one PostgreSQL database share the
port, each with its reconciler and executor; every job runs once, long polls are woken across
processes; SQLite refuses more than one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.distributed.conftest import free_port
from tests.service.conftest import layer_swap, postgres_database
from tests.webhooks.receiver import wait_for

LAYERSWAP = str(Path(sys.executable).parent / "layerswap")


def environment(tmp_path: Path, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env.update(LAYERSWAP_DATA_DIR=str(tmp_path / "data"), LAYERSWAP_RECONCILE_INTERVAL_S="0.5",
               **values)  # fmt: skip
    return env


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def test_several_api_processes_share_one_database(tmp_path: Path, examples: Path) -> None:
    checkpoints = tmp_path / "data" / "checkpoints"
    for name in ("math", "swh"):
        shutil.copytree(examples / name, checkpoints / name)
    port = free_port()
    with postgres_database() as url:
        env = environment(tmp_path, LAYERSWAP_DATABASE_URL=url, LAYERSWAP_PORT=str(port))
        log = (tmp_path / "serve.log").open("w")
        server = subprocess.Popen([LAYERSWAP, "serve", "--workers", "3"], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)

            def up() -> bool:
                try:
                    return client.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return server.poll() is not None

            wait_for(up, "the API", timeout=120)
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            wait_for(lambda: len(children(server.pid)) >= 3, "three API processes")
            created = [client.post("/v1/merges", json=layer_swap()) for _ in range(6)]
            assert all(r.status_code == 202 for r in created), [r.text for r in created]
            ids = [r.json()["id"] for r in created]
            for job_id in ids:
                first = client.get(f"/v1/merges/{job_id}")
                job, etag = first.json(), first.headers["etag"]
                while job["status"] not in ("succeeded", "failed", "canceled"):
                    # long polls, answered by whichever process, woken by any
                    response = client.get(
                        f"/v1/merges/{job_id}", params={"wait": 20}, headers={"If-None-Match": etag}
                    )
                    assert response.status_code in (200, 304), response.text
                    if response.status_code == 200:
                        job, etag = response.json(), response.headers["etag"]
                assert job["status"] == "succeeded" and job["attempts"] == 1, job
                types = [e["type"] for e in client.get(f"/v1/merges/{job_id}/events").json()]
                assert types.count("running") == 1 and types.count("succeeded") == 1
            client.close()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
            log.close()


def test_sqlite_refuses_more_than_one_process(tmp_path: Path) -> None:
    refused = subprocess.run([LAYERSWAP, "serve", "--workers", "2"], env=environment(tmp_path),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "needs PostgreSQL" in refused.stderr
