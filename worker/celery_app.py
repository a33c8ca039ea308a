"""The Celery side of the `celery` executor: one task, `run_job(job_id)`, on queues by job kind.

A message carries only the job id: recipes, paths and credentials stay in PostgreSQL, which
decides what runs (compare-and-set claim). The broker only delivers, and may lose or repeat a
delivery; the service's reconciler re-dispatches what was lost, and duplicates do nothing.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from celery import Celery, signals
from celery.exceptions import Reject

from core.db.session import Database
from core.kinds import QUEUES as KIND_QUEUES
from core.kinds import kind_of
from core.settings import Settings
from worker.pipeline import run_job

log = logging.getLogger("layerswap.celery")

TASK_NAME = "layerswap.run_job"
QUEUES = KIND_QUEUES


def queue_for(kind: str) -> str:
    return kind_of(kind).queue


def make_celery(settings: Settings, *, publisher: bool = False) -> Celery:
    """The app of a worker, or with `publisher` of the API process that sends job ids
    (worker/executors.py): its Redis commands are never retried on a timeout, which lets it
    send many messages in one pipeline (kombu batches only where a replay cannot happen), and
    it sends no `task-sent` event (below)."""
    app = Celery("layerswap", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        # Acknowledge after the job, not on receipt: with late acks the running job's message
        # counts against the prefetch limit below, so a worker never holds a second job...
        task_acks_late=True,
        # ...and with a prefetch of one, a worker busy with a multi-minute merge holds no queued
        # job hostage that an idle worker could start now.
        worker_prefetch_multiplier=1,
        task_reject_on_worker_lost=True,
        broker_transport_options=_transport_options(settings, publisher=publisher),
        # Job state lives in the database: no result backend, nothing to expire or clean.
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue="merge",
        # A broker blip must not abort a merge whose progress is safe in the database.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a worker waits for Redis, however long
        worker_send_task_events=True,  # for flower: received, started, succeeded, ...
        # ...but no `task-sent` event from the API: a second publish (to the event fanout) per
        # submit, as costly as the message itself. Flower shows a job's task from the moment a
        # worker receives it; until then the job is `queued` in the API.
        task_send_sent_event=False,
        # No remote control (pidbox): nothing here sends control commands (cancel is a database
        # write), and its Redis PUBSUB subscription is what wedged a worker for good when a job
        # ended, and its ack failed, while Redis was down (a blocking read on the re-made
        # subscription, tests/distributed/test_celery.py). The job queue alone survives that.
        worker_enable_remote_control=False,
    )
    return app


def _transport_options(settings: Settings, *, publisher: bool) -> dict[str, Any]:
    """Redis's: the redelivery backstop, short socket timeouts, and (a publisher's) no retry of
    a command that timed out."""
    return {
        # Longer than any merge should take (12 h by default). Redis has no acks: a delivered,
        # unacknowledged message is handed out again once this expires, *while its task may
        # still be running* (the classic Celery-on-Redis pitfall with long tasks). The claim
        # makes such a redelivery harmless, and dead workers are found much sooner by the
        # reconciler's heartbeat check, so this is a backstop.
        "visibility_timeout": settings.broker_visibility_timeout_s,
        **_restore_sweep(settings.broker_visibility_timeout_s),
        # A submit must not hang on a dead broker: the job is in the database already,
        # and the reconciler dispatches it when Redis is back.
        "socket_connect_timeout": 2,
        "socket_timeout": 10,
        # A publish whose answer timed out is not sent again: whether it arrived is
        # unknown either way, and a lost or doubled delivery is harmless (reconciler, claim).
        "retry_on_timeout": not publisher,
    }


def _restore_sweep(visibility_timeout_s: float) -> dict[str, int]:
    """How often a worker looks for deliveries past the visibility timeout (kombu: a call every
    `interval` seconds, a Redis scan every `throttle`-th call): kombu's 100 s by default, and at
    least twice per timeout when the timeout is shorter, so a short one is honoured too."""
    interval = max(1, min(10, int(visibility_timeout_s // 4)))
    throttle = max(1, int(min(100.0, visibility_timeout_s / 2) // interval))
    return {"unacked_restore_interval": interval, "unacked_restore_throttle": throttle}


def register_task(app: Celery, settings: Settings) -> None:
    """The worker's task: the same run_job the in-process executor calls.

    A worker told to stop (Celery's warm shutdown: SIGTERM, or Ctrl+C) does not finish its
    running job: the job stops at its next check and goes back to the queue
    (worker/stopping.py), and its message back to Redis, at the head of the queue, where the
    next worker takes it at once; the worker then exits."""
    database: list[Database] = []  # opened on first use, in the process that runs tasks
    stopping = threading.Event()
    # Sent by Celery's own signal handlers, in the process that runs the tasks (solo pool).
    signals.worker_shutting_down.connect(lambda **_: stopping.set(), weak=False)

    @app.task(name=TASK_NAME, ignore_result=True)  # type: ignore[untyped-decorator]
    def run(job_id: str) -> None:
        if not database:
            database.append(Database(settings.database))
        if stopping.is_set() or run_job(
            job_id, db=database[0], settings=settings, stopping=stopping
        ):
            raise Reject("the worker is stopping: the job goes back to the queue", requeue=True)


def waiting_job_ids(app: Celery) -> set[str]:
    """Job ids of the messages waiting in Redis's queues. Raises (kombu/redis errors) when the
    broker cannot be reached.

    Delivered, unacknowledged messages are not counted: their job is running (claimed on
    delivery) or their worker died before claiming, in which case the job, still queued, must
    be sent again rather than wait out the visibility timeout."""
    ids: set[str] = set()
    with app.connection_for_read() as connection:
        channel: Any = connection.default_channel
        keys = [key for queue in QUEUES for key in _queue_keys(channel, queue)]
        with channel.conn_or_acquire() as client:
            for key in dict.fromkeys(keys):
                ids.update(_job_id(raw) for raw in client.lrange(key, 0, -1))
    ids.discard("")
    return ids


def queue_lengths(app: Celery) -> dict[str, int]:
    """Messages waiting in each queue (all its priority levels), delivered ones not counted.
    Raises (kombu/redis errors) when the broker cannot be reached."""
    with app.connection_for_read() as connection:
        channel: Any = connection.default_channel
        with channel.conn_or_acquire() as client:
            return {
                queue: sum(int(client.llen(key)) for key in _queue_keys(channel, queue))
                for queue in QUEUES
            }


def _queue_keys(channel: Any, queue: str) -> list[str]:
    """The Redis lists holding a queue's messages: one per priority level kombu keeps."""
    return list(dict.fromkeys(channel._q_for_pri(queue, pri) for pri in channel.priority_steps))


def _job_id(raw: bytes | str) -> str:
    """Our task ids are `<job id>.<nonce>`; anything else in the queue is not ours."""
    try:
        task_id = str(json.loads(raw)["headers"]["id"])
    except (ValueError, KeyError, TypeError):
        return ""
    return task_id.split(".", 1)[0]
