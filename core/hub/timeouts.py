"""Every Hub request is bounded: a Hub that stops answering, or answers a trickle, fails the
request instead of holding a submit or a job forever.

The client (huggingface_hub over httpx2) waits without limit by default, and a per-read timeout
alone would not do: a server sending one byte per second satisfies it forever. So the sockets of
the client's connections are wrapped (its connection pools' network backend):
- connecting, and each read and write, waits `timeout_s` (whatever the client asked for: one
  setting says how long the service waits for the Hub);
- once an answer's first byte has come, the answer must keep up `min_bytes_per_s` on average
  over every `timeout_s` (curl's low-speed limit): a shard downloads at whatever speed the link
  has, a trickle is cut off after `timeout_s`.
A request cut off raises HubStalled, which no retry loop (the client's, or ours) retries: a stuck
Hub would only hold the job that much longer. hub_errors turns it into HubTimeout.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore2
from huggingface_hub import set_client_factory
from huggingface_hub.utils._http import default_client_factory


class HubStalled(Exception):
    """A Hub request that got no answer in time, or too slow a one."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    min_bytes_per_s: int


# Settings' defaults, until a process configures its own (create_app, each job's pipeline).
_limits = Limits(timeout_s=60.0, min_bytes_per_s=1024)
_installed = False
_install_lock = threading.Lock()


def configure(timeout_s: float, min_bytes_per_s: int) -> None:
    """The limits for every Hub request from now on (connections open included)."""
    global _limits
    _limits = Limits(timeout_s, min_bytes_per_s)


def current() -> Limits:
    return _limits


def install() -> None:
    """Make the client's shared session a bounded one (once per process)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if not _installed:
            set_client_factory(_bounded_client)
            _installed = True


def _bounded_client() -> Any:
    """The client's own default session, its connection pools' sockets wrapped. The pools are
    reached through private attributes of httpx2 and httpcore2 (pinned versions); the tests of
    a stuck Hub fail if they move."""
    client = default_client_factory()
    for transport in [client._transport, *client._mounts.values()]:
        pool = getattr(transport, "_pool", None)
        if pool is not None and hasattr(pool, "_network_backend"):
            pool._network_backend = _Backend(pool._network_backend)
    return client


class _Backend(httpcore2.NetworkBackend):
    def __init__(self, inner: httpcore2.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.NetworkStream:
        return _opened(
            "connection to",
            lambda limit: self._inner.connect_tcp(host, port, limit, local_address, socket_options),
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore2.NetworkStream:
        return _opened(
            "connection to",
            lambda limit: self._inner.connect_unix_socket(path, limit, socket_options),
        )

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _Stream(httpcore2.NetworkStream):
    """One connection's socket, with the limits; the pace of an answer is measured from its
    first byte (sending a request resets it, so a connection kept alive idle is never slow)."""

    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner
        self._since: float | None = None
        self._got = 0

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        limits = _limits
        self._keep_pace(limits)
        try:
            data = self._inner.read(max_bytes, limits.timeout_s)
        except httpcore2.ReadTimeout:
            raise HubStalled(f"the Hub sent nothing for {limits.timeout_s:g} s") from None
        if self._since is None:
            self._since, self._got = time.monotonic(), 0
        self._got += len(data)
        return data

    def _keep_pace(self, limits: Limits) -> None:
        if self._since is None:
            return
        elapsed = time.monotonic() - self._since
        if elapsed < limits.timeout_s:
            return
        if self._got < limits.min_bytes_per_s * elapsed:
            raise HubStalled(
                f"the Hub sent {self._got} bytes in {elapsed:.0f} s, slower than "
                f"{limits.min_bytes_per_s} bytes/s"
            )
        self._since, self._got = time.monotonic(), 0

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        limit = _limits.timeout_s
        self._since = None
        try:
            self._inner.write(buffer, limit)
        except httpcore2.WriteTimeout:
            raise HubStalled(f"the Hub took nothing for {limit:g} s") from None

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore2.NetworkStream:
        return _opened(
            "TLS session with",
            lambda limit: self._inner.start_tls(ssl_context, server_hostname, limit),
        )

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def _opened(what: str, open_within: Callable[[float], httpcore2.NetworkStream]) -> _Stream:
    """A connection or TLS session opened within the Hub limit, else HubStalled saying which."""
    limit = _limits.timeout_s
    try:
        stream = open_within(limit)
    except httpcore2.ConnectTimeout:
        raise HubStalled(f"no {what} the Hub within {limit:g} s") from None
    return _Stream(stream)
