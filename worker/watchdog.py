"""A worker that stops taking messages while messages wait is reconnected to the broker.

kombu's Redis transport can lose its BRPOP registration for good: when a job ends while Redis is
down, the failed ack closes the consumer's sockets, and the event loop then waits on nothing,
forever, with Redis back and jobs queued (tests/distributed/test_celery.py). Nothing fails, so
Celery's own recovery never starts. This consumer step looks, every `worker_watchdog_s`, at what
this worker could take: idle (nothing running or reserved), messages waiting in its queues,
and nothing done since the last look, twice in a row, is a wedge. It then raises a connection
error inside the event loop, which is the path Celery takes when it sees the broker go away:
the consumer is rebuilt on a fresh connection and takes the waiting messages.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import bootsteps
from celery.worker import state

log = logging.getLogger("layerswap.watchdog")


class BrokerWedged(ConnectionError):
    """A builtin ConnectionError (an OSError): one of every kombu transport's connection
    errors, which the event loop propagates and the consumer answers by reconnecting."""


class ConsumerWatchdog(bootsteps.StartStopStep):
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None
        self._last: tuple[int, bool] | None = None  # (tasks done, idle with messages waiting)

    def start(self, c: Any) -> None:
        interval = float(c.app.conf.layerswap_watchdog_s)
        self._last = None
        self._broker = redis.Redis.from_url(
            c.app.conf.broker_url, socket_timeout=2, socket_connect_timeout=2
        )
        self._queues = [queue.name for queue in c.task_consumer.queues]
        self._timer = c.timer.call_repeatedly(interval, self.check, priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    shutdown = stop

    def check(self) -> None:
        done = state.all_total_count[0]
        stuck = self._idle() and self._waiting() > 0
        last, self._last = self._last, (done, stuck)
        if stuck and last == (done, True):
            self._last = None
            log.error(
                "idle for two checks with messages waiting in %s: reconnecting to the broker",
                ", ".join(self._queues),
            )
            raise BrokerWedged("consumer took no message while messages waited")

    def _idle(self) -> bool:
        return not state.active_requests and not state.reserved_requests

    def _waiting(self) -> int:
        try:
            return sum(int(self._broker.llen(name)) for name in self._queues)
        except redis.RedisError:
            return 0  # the broker is away: Celery's own reconnection deals with that


def install(app: Any, interval_s: float) -> None:
    """Add the watchdog to `app`'s worker consumer (before the worker starts)."""
    app.conf.layerswap_watchdog_s = interval_s
    app.steps["consumer"].add(ConsumerWatchdog)
