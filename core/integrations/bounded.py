"""Calls to a system outside the service with a deadline for the whole call.

The clients of those systems (MLflow's, openlineage-python's) bound each socket read, not a
call: a server that answers one byte at a time, or their own retries, can hold a call for
hours. Here the call runs on a daemon thread and the caller waits for it until the deadline,
then goes on without it. The abandoned thread is left to end on its own (its client's own
timeouts end it, or the server closing the connection); while `max_abandoned` of them are
still waiting, further calls are refused at once instead of piling up threads and sockets on
a system that does not answer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class CallAbandoned(Exception):
    """The call did not end within its deadline, or the system still holds earlier ones."""


class _Outcome(Generic[T]):
    def __init__(self) -> None:
        self.value: T | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class Bounded:
    def __init__(self, system: str, *, max_abandoned: int = 2) -> None:
        self.system, self.max_abandoned = system, max_abandoned
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()

    def call(
        self, fn: Callable[[], T], timeout_s: float, *, abandoned: threading.Event | None = None
    ) -> T:
        """`fn()`'s value (or its exception), if it ends within `timeout_s`; CallAbandoned
        otherwise, with `abandoned` set (`fn` may look at it to stop before its next write)."""
        self._refuse_while_stuck()
        outcome: _Outcome[T] = _Outcome()

        def run() -> None:
            try:
                outcome.value = fn()
            except BaseException as e:  # thread boundary: handed to the caller, who raises it
                outcome.error = e
            finally:
                outcome.done.set()

        thread = threading.Thread(target=run, name=f"{self.system}-call", daemon=True)
        thread.start()
        if not outcome.done.wait(timeout_s):
            if abandoned is not None:
                abandoned.set()
            with self._lock:
                self._abandoned.append(thread)
            raise CallAbandoned(f"{self.system} did not answer within {timeout_s:g} s")
        if outcome.error is not None:
            raise outcome.error
        return cast(T, outcome.value)  # set, since no error was

    def _refuse_while_stuck(self) -> None:
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            waiting = len(self._abandoned)
        if waiting >= self.max_abandoned:
            raise CallAbandoned(
                f"not tried: {self.system} has not answered {waiting} earlier call(s) yet"
            )
