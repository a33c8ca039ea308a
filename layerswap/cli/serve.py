"""`layerswap serve` (the API, with its executor) and `layerswap worker` (a Celery worker)."""

from __future__ import annotations

import copy
import os
from typing import Any

import click
import uvicorn
import uvicorn.config

from core.db.migrate import upgrade
from core.db.session import Database
from core.settings import Settings
from core.webhooks.encryption import SecretKeyError, box_for, prepare
from layerswap.app import build_app
from layerswap.cli.common import check_merge_device, fail, load_settings
from worker import watchdog
from worker.celery_app import QUEUES, make_celery, register_task


@click.command()
@click.option("--host", help="Bind address (default LAYERSWAP_HOST or 127.0.0.1).")
@click.option("--port", type=int, help="Port (default LAYERSWAP_PORT or 8000).")
@click.option(
    "--workers", type=click.IntRange(1, 64), default=1, show_default=True,
    help="API processes sharing the port (more than one needs PostgreSQL).",
)  # fmt: skip
def serve(host: str | None, port: int | None, workers: int) -> None:
    """Run the HTTP API; with no configuration, on the embedded default (SQLite, in-process)."""
    settings = load_settings(host=host, port=port)
    check_merge_device(settings)  # the in-process executor merges here
    if workers > 1 and settings.database.startswith("sqlite"):
        fail(
            "invalid_settings",
            "--workers > 1 needs PostgreSQL (LAYERSWAP_DATABASE_URL): SQLite has one writer "
            "at a time",
            2,
        )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    for root in settings.source_roots:
        root.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    check_webhook_keys(settings)
    click.echo(
        f"layerswap: serving on http://{settings.host}:{settings.port} "
        f"(database {settings.database.split('@')[-1]}, executor {settings.executor}, "
        f"{workers} process{'es' if workers > 1 else ''})"
    )
    if workers == 1:
        uvicorn.run(build_app(settings), host=settings.host, port=settings.port,
                    log_level="info", log_config=serve_logging())  # fmt: skip
        return
    # Each process builds its own app from the environment: pass the overrides on.
    os.environ.update(LAYERSWAP_HOST=settings.host, LAYERSWAP_PORT=str(settings.port))
    uvicorn.run(
        "layerswap.app:app_from_environment", factory=True, workers=workers,
        host=settings.host, port=settings.port, log_level="info", log_config=serve_logging(),
    )  # fmt: skip


def serve_logging() -> dict[str, Any]:
    """uvicorn's logging, with each request's access line written by a plain formatter (the
    same words, no colours): uvicorn's own copies every record to colour it, which cost a
    tenth of the CPU of a page of merges."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["access"] = {"format": "%(levelname)s:     %(message)s"}
    return config


def check_webhook_keys(settings: Settings) -> None:
    """Keys that cannot decrypt the stored webhook secrets stop the start in one line, before
    the API is up (its start-up would say the same under a traceback)."""
    try:
        prepare(Database(settings.database), box_for(settings))
    except SecretKeyError as e:
        fail("invalid_settings", str(e), 2)


@click.command()
@click.option(
    "--queues",
    default="merge,eval",
    show_default=True,
    help="Comma-separated queues to take jobs from (merge, eval).",
)
@click.option("--hostname", help="Worker name shown in flower (default: celery@<host>).")
@click.option("--loglevel", default="INFO", show_default=True)
@click.option(
    "--nice", type=click.IntRange(0, 19), default=0, show_default=True,
    help="Lower this worker's CPU priority by this much (as nice(1) does). For a host the "
    "worker shares with the API: merges then take the CPU the API leaves, and requests are "
    "answered first. Pointless where workers have machines of their own.",
)  # fmt: skip
def worker(queues: str, hostname: str | None, loglevel: str, nice: int) -> None:
    """Run a Celery worker: one job at a time, in this process (no fork: CUDA does not survive
    one). Configuration comes from the same LAYERSWAP_* variables as `serve`."""
    chosen = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(chosen) - set(QUEUES))
    if unknown or not chosen:
        given = ", ".join(unknown) or "none given"
        fail("invalid_queues", f"{given}: queues are {', '.join(QUEUES)}", 2)
    settings = load_settings()
    check_merge_device(settings)
    if nice:
        os.nice(nice)  # before any thread starts: every thread of the process has it
    app = make_celery(settings)
    register_task(app, settings)
    watchdog.install(app, settings.worker_watchdog_s)
    argv = [
        "worker",
        # solo: the task runs in the worker's own process, one at a time. The prefork pool would
        # fork children after import (CUDA cannot be used across fork) and run several merges
        # at once, each wanting the whole GPU. Scale out with more worker processes instead.
        "--pool=solo",
        "--concurrency=1",
        f"--queues={','.join(chosen)}",
        f"--loglevel={loglevel}",
        "--without-gossip",  # nothing here uses worker-to-worker chatter; it costs a connection
        "--without-mingle",
    ]
    if hostname:
        argv.append(f"--hostname={hostname}")
    app.worker_main(argv)
