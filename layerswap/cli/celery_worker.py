"""`layerswap worker`: a Celery worker (the `worker` extra: no web framework is imported)."""

from __future__ import annotations

import os

import click

from layerswap.cli.common import check_merge_device, fail, load_settings
from worker import watchdog
from worker.celery_app import QUEUES, make_celery, register_task


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
