"""docker-compose.yml, run: one deployment for the whole module, built from this checkout with
the stand-in images of deploy/compose.test.yml, driven from the host through the published port
with the Python client, as the README's "Deploy with Docker Compose" section does. The steps run
in order and build on each other: examples and keys first, then merges, an evaluation and a
sweep, a worker killed mid-merge and one stopped mid-merge, PostgreSQL and Redis restarted,
containers stopped during their start-up, `down` and `up`, `down -v`.

Selected with `-m docker`; skipped where no Docker engine answers (scripts/docker.sh)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from layerswap_client import Client
from tests.docker.compose import (
    ROOT,
    Compose,
    cpu_limit,
    docker,
    docker_available,
    free_port,
    image_config,
    wait_for,
)

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(docker_available() is not None, reason=str(docker_available())),
    pytest.mark.timeout(1800),
]

SWAP = {"bottom": 1, "top": 1, "non_layer": "average"}
EVALUATION = {"tasks": ["mgsm_local_direct_sw"], "num_fewshot": 0, "max_gen_toks": 8}
STEP_TIMEOUT = 300
SLOW_CPUS = 0.1  # a capped worker's CPU share while a test stops it mid-merge
LAYERSWAP = str(Path(sys.executable).parent / "layerswap")  # the host's CLI, beside pytest's Python


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    """Stand-ins built (the Debian base only when missing), images built, `up -d`, ready."""
    compose = Compose(
        project=f"lstest{secrets.token_hex(3)}",
        env={
            "API_PORT": str(free_port()),
            "FLOWER_PORT": str(free_port()),
            "FLOWER_BASIC_AUTH": f"ops:{secrets.token_hex(8)}",
            "POSTGRES_PASSWORD": secrets.token_hex(12),
        },
    )
    started = time.monotonic()
    subprocess.run(
        ["bash", str(ROOT / "deploy" / "test" / "build-standins.sh")],
        env={**os.environ, "PYTHON": sys.executable}, check=True, timeout=900,
    )  # fmt: skip
    compose.timings["standins_s"] = time.monotonic() - started
    started = time.monotonic()
    compose.run("build")
    compose.timings["build_s"] = time.monotonic() - started
    started = time.monotonic()
    try:
        compose.run("up", "-d")
        compose.wait_ready()
        compose.timings["up_to_ready_s"] = time.monotonic() - started
        compose.up_started = started
        yield compose
    finally:
        compose.run("down", "-v", "--remove-orphans", check=False)
        print("compose timings:", {k: round(v, 1) for k, v in compose.timings.items()})


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What one step leaves for the next (keys, job ids, digests)."""
    return {}


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.examples import make_examples

    root = tmp_path_factory.mktemp("compose-examples")
    make_examples(root)
    return root


def client(compose: Compose, key: str, retries: int = 4) -> Client:
    return Client(compose.api_url, api_key=key, max_retries=retries, timeout=60)


def sha256s(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.suffix in (".safetensors", ".json")
        and p.name != "layerswap.json"  # the manifest names the inputs' paths
    }  # fmt: skip


# -- the deployment ------------------------------------------------------------------------


def test_the_deployment_is_ready_non_root_and_keeps_no_secret_in_its_image(
    deployment: Compose,
) -> None:
    ready = httpx.get(f"{deployment.api_url}/readyz").json()
    assert ready == {"status": "ready", "broker": "ok"}  # the database and Redis, both asked
    assert "database schema migrated from <none> to " in deployment.logs("migrate")
    for service in ("api", "worker-cpu", "flower"):
        assert deployment.exec(service, "id", "-u") == "1000", service
    config = image_config("layerswap:latest")
    assert config["User"] == "layerswap"
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", "layerswap:latest")
    for secret in (deployment.env["POSTGRES_PASSWORD"], deployment.env["FLOWER_BASIC_AUTH"]):
        assert secret not in history and secret not in str(config)
    # No layer sets or passes anything secret-like (build args show in the history too).
    assert not re.search(r"PASSWORD|BASIC_AUTH|CREDENTIALS|SECRET|DATABASE_URL", history.upper())
    assert not [e for e in config["Env"] if e.startswith(("LAYERSWAP_DATABASE", "LAYERSWAP_HUB"))]
    # flower: this host's loopback only, and only with the password
    assert httpx.get(deployment.flower_url).status_code == 401
    user, password = deployment.env["FLOWER_BASIC_AUTH"].split(":")
    assert httpx.get(deployment.flower_url, auth=(user, password)).status_code == 200
    ports = docker("port", deployment.container("flower"))
    assert ports.strip().endswith(f"127.0.0.1:{deployment.env['FLOWER_PORT']}")


def test_keys_for_two_tenants_and_the_examples_in_the_data_volume(
    deployment: Compose, examples: Path, state: dict[str, Any]
) -> None:
    for tenant in ("team-a", "team-b"):
        key = deployment.exec("api", "layerswap", "keys", "create", "--tenant", tenant)
        assert key.startswith("lsk_"), key
        state[tenant] = key
    deployment.copy_in("api", examples, "/data/checkpoints")
    deployment.copy_in("api", examples / "eval-data", "/data/eval-data")
    listed = deployment.exec("worker-cpu", "ls", "/data/checkpoints")
    assert {"base", "math", "swh"} <= set(listed.split())
    unauthenticated = httpx.get(f"{deployment.api_url}/v1/merges")
    assert unauthenticated.status_code == 401


def test_a_layer_swap_through_the_port_equals_the_cli_merge(
    deployment: Compose, examples: Path, state: dict[str, Any], tmp_path: Path
) -> None:
    recipe = {
        "method": "layer_swap",
        "experts": {"task": ["/data/checkpoints/math"], "language": ["/data/checkpoints/swh"]},
        "params": SWAP,
        "output": {"name": "swap-1"},
    }
    with client(deployment, state["team-a"]) as api:
        job = api.merges.create(recipe)
        done = api.merges.wait(job.id, timeout=STEP_TIMEOUT)
    deployment.timings["up_to_first_job_s"] = time.monotonic() - deployment.up_started
    assert done.status == "succeeded", done.error
    assert done.output is not None
    state["swap"] = done
    local = {**recipe, "experts": {"task": [str(examples / "math")],
                                   "language": [str(examples / "swh")]}}  # fmt: skip
    recipe_file = tmp_path / "recipe.json"  # JSON is YAML
    recipe_file.write_text(json.dumps({k: v for k, v in local.items() if k != "output"}))
    subprocess.run(
        [LAYERSWAP, "merge", str(recipe_file), "--out", str(tmp_path / "cli"), "--no-fsync"],
        check=True, capture_output=True,
    )  # fmt: skip
    expected = sha256s(tmp_path / "cli")
    served = {f["name"]: f["sha256"] for f in done.output.files if f["name"] in expected}
    assert served == expected and "model.safetensors" in served


def test_an_evaluation_a_sweep_and_a_webhook_through_the_port(
    deployment: Compose, state: dict[str, Any]
) -> None:
    with client(deployment, state["team-a"]) as api:
        artifact = state["swap"].output.artifact_id
        evaluation = api.evaluations.create({"artifact_id": artifact, "evaluation": EVALUATION})
        sweep = api.sweeps.create({
            "task_experts": ["/data/checkpoints/math"],
            "language_experts": ["/data/checkpoints/swh"],
            "grid": {"bottom": [1, 2], "top": [1]},
            "evaluation": EVALUATION,
            "objective": {"task": "mgsm_local_direct_sw", "metric": "exact_match"},
        })  # fmt: skip
        # a receiver inside the deployment's network (that one answers 405: kept, not delivered)
        state["webhook"] = api.webhooks.create("http://api:8000/healthz")
        scored = api.evaluations.wait(evaluation.id, timeout=STEP_TIMEOUT)
        assert scored.status == "succeeded", scored.error
        assert scored.result and scored.result["scores"]
        swept = api.sweeps.wait(sweep.id, timeout=STEP_TIMEOUT)
        assert swept.status == "succeeded"
        board = api.sweeps.leaderboard(sweep.id)
    assert len(board["rows"]) == 2, board
    state["scores"] = scored.result["scores"]


@pytest.fixture(scope="module")
def large_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two float32 experts of about 550 MB: a merge that takes long enough to be killed."""
    import torch

    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("compose-large")
    make_checkpoint(
        root / "task", layers=4, hidden=1024, intermediate=2048, vocab=49152,
        heads=4, kv_heads=2, dtype=torch.float32, seed=1,
    )  # fmt: skip
    make_checkpoint(root / "language", base=root / "task", dtype=torch.float32, seed=2,
                    non_layer_scale=0.03)  # fmt: skip
    return root


def job_row(compose: Compose, key: str, job_id: str) -> dict[str, Any]:
    response = httpx.get(f"{compose.api_url}/v1/merges/{job_id}",
                         headers={"Authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip
    assert response.status_code == 200, response.text
    return dict(response.json())


def unacked(compose: Compose) -> list[dict[str, Any]]:
    """Redis's delivered, unacknowledged messages (kombu's `unacked` hash)."""
    values = compose.exec("redis", "redis-cli", "HVALS", "unacked")
    return [json.loads(line)[0] for line in values.splitlines() if line.strip()]


def test_a_worker_killed_mid_merge_is_replaced_and_the_job_succeeds_once(
    deployment: Compose, large_pair: Path, state: dict[str, Any]
) -> None:
    deployment.copy_in("api", large_pair, "/data/checkpoints/large")
    key = state["team-a"]
    recipe = {
        "method": "layer_swap",
        "experts": {"task": ["/data/checkpoints/large/task"],
                    "language": ["/data/checkpoints/large/language"]},
        "params": SWAP,
        "output": {"name": "killed"},
    }  # fmt: skip
    worker = deployment.container("worker-cpu")
    cpu_limit(worker, SLOW_CPUS)
    with client(deployment, key) as api:
        job = api.merges.create(recipe)

    def merging_or_ended() -> str | None:
        row = job_row(deployment, key, job.id)
        ended = row["status"] in ("succeeded", "failed", "canceled")
        return row["status"] if ended else "merging" if row["stage"] == "merging" else None

    seen = wait_for(merging_or_ended, "the merge to start", timeout=STEP_TIMEOUT, every=0.05)
    assert seen == "merging", f"the merge ended ({seen}) before it could be killed"
    docker("kill", worker)
    cpu_limit(worker, None)
    stale = [m for m in unacked(deployment) if m["headers"]["id"].startswith(job.id)]
    assert len(stale) == 1, "the killed attempt's message stays unacknowledged in Redis"
    state["stale_task"] = stale[0]["headers"]["id"]

    deployment.run("up", "-d")
    with client(deployment, key) as api:
        done = api.merges.wait(job.id, timeout=STEP_TIMEOUT)
        events = [e.type for e in api.merges.events(job.id)]
    assert done.status == "succeeded" and done.attempts == 2, (done.status, done.error)
    assert events.count("succeeded") == 1, events
    # Still held by Redis: its redelivery, checked below, comes after the job has succeeded.
    assert state["stale_task"] in [m["headers"]["id"] for m in unacked(deployment)]
    state["killed"] = done
    state["killed_events"] = events
    outputs = deployment.exec("api", "ls", "-A", "/data/artifacts/team-a").split()
    assert "killed" in outputs
    assert not [name for name in outputs if name.startswith(".")], outputs  # no staging left


INIT_CHILD = "the init (PID 1) to start its child: is the service's `init: true` gone?"


def processes(container: str) -> list[str]:
    """The container's processes (their pids), by `docker top`."""
    return docker("top", container, "-o", "pid").split()[1:]


def container_state(container: str) -> dict[str, Any]:
    return dict(json.loads(docker("inspect", container))[0]["State"])


def test_a_worker_stopped_mid_merge_hands_its_job_back_and_exits(
    deployment: Compose, state: dict[str, Any]
) -> None:
    """`docker stop -t 20`: SIGTERM, then SIGKILL (exit status 137) if the container is still
    running 20 s later. The worker stops the merge at once, hands its job back to the queue and
    exits by itself; restarted, it runs the job again, to the killed merge's same weights."""
    key = state["team-a"]
    recipe = {
        "method": "layer_swap",
        "experts": {"task": ["/data/checkpoints/large/task"],
                    "language": ["/data/checkpoints/large/language"]},
        "params": SWAP,
        "output": {"name": "stopped"},
    }  # fmt: skip
    container = deployment.container("worker-cpu")  # looked up first: the merge takes seconds
    cpu_limit(container, SLOW_CPUS)
    with client(deployment, key) as api:
        job = api.merges.create(recipe)

    def early_in_the_merge_or_ended() -> str | None:
        row = job_row(deployment, key, job.id)
        if row["status"] in ("succeeded", "failed", "canceled"):
            return str(row["status"])
        progress = row["progress"]
        early = row["stage"] == "merging" and progress["done"] < progress["total"] / 2
        return "merging" if early else None

    seen = wait_for(early_in_the_merge_or_ended, "the merge", timeout=STEP_TIMEOUT, every=0.05)
    assert seen == "merging", f"the merge ended ({seen}) before it could be stopped"
    cpu_limit(container, None)  # the stop itself runs at full speed, as in production
    docker("stop", "-t", "20", container)
    stopped = container_state(container)
    assert (stopped["Status"], stopped["ExitCode"]) == ("exited", 0), stopped
    row = job_row(deployment, key, job.id)
    assert (row["status"], row["attempts"]) == ("queued", 1), row
    outputs = deployment.exec("api", "ls", "-A", "/data/artifacts/team-a").split()
    assert "stopped" not in outputs and not [n for n in outputs if n.startswith(".")], outputs

    deployment.run("start", "worker-cpu")
    with client(deployment, key) as api:
        done = api.merges.wait(job.id, timeout=STEP_TIMEOUT)
    assert done.status == "succeeded" and done.attempts == 2, (done.status, done.error)
    assert done.output is not None and state["killed"].output is not None

    def weights(files: list[dict[str, Any]]) -> dict[str, str]:
        return {f["name"]: f["sha256"] for f in files if f["name"].endswith(".safetensors")}

    assert weights(done.output.files) == weights(state["killed"].output.files)


def small_swap(name: str) -> dict[str, Any]:
    return {
        "method": "layer_swap",
        "experts": {"task": ["/data/checkpoints/math"], "language": ["/data/checkpoints/swh"]},
        "params": SWAP,
        "output": {"name": name},
    }


def test_postgres_restarted_under_load_is_a_503_then_recovers_and_loses_no_job(
    deployment: Compose, state: dict[str, Any]
) -> None:
    key = state["team-a"]
    headers = {"Authorization": f"Bearer {key}"}
    with client(deployment, key) as api:
        submitted = [api.merges.create(small_swap(f"pg-{i}")).id for i in range(6)]
    deployment.run("stop", "postgres")

    def outage_answer() -> dict[str, Any] | None:
        response = httpx.get(f"{deployment.api_url}/v1/merges/{submitted[0]}", headers=headers)
        return dict(response.json()) if response.status_code == 503 else None

    error = wait_for(outage_answer, "the API to answer 503", timeout=60)
    assert error["error"]["code"] == "database_unavailable", error
    refused = httpx.post(f"{deployment.api_url}/v1/merges", headers=headers,
                         json=small_swap("pg-down"))  # fmt: skip
    assert refused.status_code == 503 and "Retry-After" in refused.headers
    assert httpx.get(f"{deployment.api_url}/readyz").status_code == 503

    deployment.run("start", "postgres")
    deployment.wait_ready(timeout=120)  # the API recovers by itself
    with client(deployment, key) as api:
        for job_id in submitted:
            assert api.merges.wait(job_id, timeout=STEP_TIMEOUT).status == "succeeded"


def test_redis_restarted_loses_no_queued_job(deployment: Compose, state: dict[str, Any]) -> None:
    key = state["team-a"]
    deployment.run("stop", "worker-cpu")
    with client(deployment, key) as api:
        queued = [api.merges.create(small_swap(f"redis-{i}")).id for i in range(3)]
        assert {api.merges.get(job_id).status for job_id in queued} == {"queued"}
    deployment.run("restart", "redis")
    assert deployment.wait_ready(timeout=120) == {"status": "ready", "broker": "ok"}
    deployment.run("start", "worker-cpu")
    with client(deployment, key) as api:
        for job_id in queued:
            assert api.merges.wait(job_id, timeout=STEP_TIMEOUT).status == "succeeded"


def test_the_killed_attempts_stale_message_redelivered_changes_nothing(
    deployment: Compose, state: dict[str, Any]
) -> None:
    """Redis hands the killed attempt's message out again once the visibility timeout (short
    in the test) has passed; the worker takes it, and the claim turns it away."""
    stale, before = state["stale_task"], state["killed"]
    wait_for(
        lambda: f"[{stale}] received" in deployment.logs("worker-cpu")
        and not any(m["headers"]["id"] == stale for m in unacked(deployment)),
        "the stale message to be redelivered and acknowledged", timeout=STEP_TIMEOUT, every=2,
    )  # fmt: skip
    assert f"job {before.id}: not queued" in deployment.logs("worker-cpu")
    with client(deployment, state["team-a"]) as api:
        after = api.merges.get(before.id)
        events = [e.type for e in api.merges.events(before.id)]
    assert (after.status, after.attempts, after.finished_at) == (
        "succeeded", 2, before.finished_at
    )  # fmt: skip
    assert after.output == before.output and events == state["killed_events"]


def test_tenant_b_cannot_see_tenant_a(deployment: Compose, state: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {state['team-b']}"}
    mine = httpx.get(f"{deployment.api_url}/v1/merges", headers=headers)
    assert mine.status_code == 200 and mine.json()["items"] == [], mine.text
    theirs = state["swap"]
    for path in (f"/v1/merges/{theirs.id}", f"/v1/artifacts/{theirs.output.artifact_id}"):
        response = httpx.get(f"{deployment.api_url}{path}", headers=headers)
        assert response.status_code == 404, (path, response.text)


def test_every_container_stops_within_seconds_during_its_start_up(deployment: Compose) -> None:
    """`docker stop -t 20` right after the containers start, while each Python process still
    imports (for seconds, before Celery or uvicorn install their signal handlers): each
    container exits on the SIGTERM (an init as PID 1 passes it on), none on the SIGKILL 20 s
    later (status 137)."""
    services = ("api", "worker-cpu", "flower")
    deployment.run("up", "--no-start", "--no-deps", "--force-recreate", *services)
    containers = {service: deployment.container(service) for service in services}
    try:
        # Started and stopped back to back (compose's own commands take seconds between the
        # two, time enough for an idle machine to finish the imports): each process is still
        # starting, whatever the machine's load.
        docker("start", *containers.values())
        # Until the init has started its child it has not blocked the signals it forwards, and
        # the kernel drops a SIGTERM sent to a PID 1 without a handler: wait for the child only.
        for container in containers.values():
            wait_for(lambda c=container: len(processes(c)) >= 2, INIT_CHILD, timeout=60, every=0.05)
        docker("stop", "-t", "20", *containers.values())
        for service, container in containers.items():
            stopped = container_state(container)
            assert stopped["Status"] == "exited" and stopped["ExitCode"] != 137, (
                service,
                stopped,
                deployment.logs(service)[-2000:],
            )
        assert " ready." not in deployment.logs("worker-cpu"), "stopped during its start-up"
    finally:  # the next tests use the deployment, whatever happened here
        deployment.run("up", "-d")
        deployment.wait_ready()


def test_down_and_up_keep_jobs_artifacts_scores_and_webhooks(
    deployment: Compose, state: dict[str, Any]
) -> None:
    with client(deployment, state["team-a"]) as api:
        swap = api.merges.get(state["swap"].id)  # its model card now holds the scores
    assert swap.output is not None
    model = f"/data/artifacts/team-a/{swap.output.name}/model.safetensors"
    digest = deployment.exec("api", "sha256sum", model).split()[0]
    deployment.run("down")
    assert deployment.running() == []
    deployment.run("up", "-d")
    deployment.wait_ready()
    with client(deployment, state["team-a"]) as api:
        kept = api.merges.get(swap.id).output
        assert kept is not None
        assert kept.model_dump() == swap.output.model_dump(), (kept, swap.output)
        scores = api.get(f"/v1/artifacts/{swap.output.artifact_id}/evaluations")
        assert scores, "the evaluation's scores are kept"
        assert [w.id for w in api.webhooks.list()] == [state["webhook"].id]
    assert deployment.exec("api", "sha256sum", model).split()[0] == digest


def test_down_v_leaves_nothing_running(deployment: Compose) -> None:
    deployment.run("down", "-v")
    assert deployment.running() == []
    label = f"label=com.docker.compose.project={deployment.project}"
    assert docker("volume", "ls", "-q", "--filter", label).split() == []
