"""The synchronous client: `Client(url).merges.create(recipe)`, `.wait(id)`, `.events(id)`, …

Every POST carries an Idempotency-Key (one per call, the same on each of its retries), so a
retry after a dropped response never creates a second job."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from layerswap_client import _retry
from layerswap_client.errors import WaitTimeout
from layerswap_client.models import (
    Artifact,
    Event,
    Job,
    Method,
    Sweep,
    WebhookDelivery,
    WebhookEndpoint,
)

DEFAULT_URL = "http://127.0.0.1:8000"


class Client:
    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        max_retries: int = 4,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`base_url` defaults to LAYERSWAP_URL or the embedded default's address; `api_key`
        to LAYERSWAP_API_KEY."""
        api_key = api_key or os.environ.get("LAYERSWAP_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_retries = max_retries
        self._http = httpx.Client(
            base_url=base_url or os.environ.get("LAYERSWAP_URL", DEFAULT_URL),
            headers={"User-Agent": "layerswap-client/0.1", **headers},
            timeout=timeout,
            transport=transport,
        )
        self.merges = Jobs(self, "merges")
        self.evaluations = Jobs(self, "evaluations")
        self.analyses = Jobs(self, "analyses")
        self.sweeps = Sweeps(self)
        self.artifacts = Artifacts(self)
        self.webhooks = Webhooks(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        safe_to_resend: bool | None = None,
    ) -> httpx.Response:
        """One call, retried on 429/503 and, where `safe_to_resend` (default: GETs and POSTs
        that carry a key the service honours), on dropped connections."""
        headers = {}
        if method == "POST":
            headers["Idempotency-Key"] = idempotency_key or uuid.uuid4().hex
        resend = method == "GET" if safe_to_resend is None else safe_to_resend
        params = {k: v for k, v in (params or {}).items() if v is not None}
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = self._http.request(
                    method, path, json=json, params=params, headers=headers
                )
            except httpx.TransportError:
                if last or not resend:
                    raise
                _retry.sleep(_retry.delay(attempt, None))
                continue
            if response.status_code in _retry.RETRY_STATUSES and not last:
                _retry.sleep(_retry.delay(attempt, response))
                continue
            if response.status_code >= 400:
                raise _retry.error_of(response)
            return response
        raise AssertionError("unreachable")

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params).json()

    def methods(self) -> list[Method]:
        """The merge methods the service offers, with their params (GET /v1/methods)."""
        return [Method.model_validate(m) for m in self.get("/v1/methods")]

    def pages(self, path: str, **params: Any) -> Iterator[Any]:
        """Every item of a cursor-paginated list, fetched a page at a time as you iterate."""
        cursor = None
        while True:
            page = self.get(path, cursor=cursor, **params)
            yield from page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return


class Jobs:
    """Merges, evaluations or analyses (`collection`)."""

    def __init__(self, client: Client, collection: str) -> None:
        self._client, self._path = client, f"/v1/{collection}"

    def create(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> Job:
        response = self._client.request(
            "POST", self._path, json=body, idempotency_key=idempotency_key, safe_to_resend=True
        )
        return Job.model_validate(response.json())

    def get(self, job_id: str) -> Job:
        return Job.model_validate(self._client.get(f"{self._path}/{job_id}"))

    def list(
        self, *, status: str | None = None, page_size: int = 50, **filters: Any
    ) -> Iterator[Job]:
        """Every job, newest first, fetched page by page as you iterate."""
        for item in self._client.pages(self._path, status=status, limit=page_size, **filters):
            yield Job.model_validate(item)

    def cancel(self, job_id: str) -> Job:
        response = self._client.request(
            "POST", f"{self._path}/{job_id}/cancel", safe_to_resend=True
        )
        return Job.model_validate(response.json())

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        poll_s: float = 1.0,
        on_progress: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll until the job ends; `on_progress` sees every state polled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if on_progress is not None:
                on_progress(job)
            if job.done:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id}", job)
            time.sleep(poll_s)

    def events(self, job_id: str, *, after: int = 0) -> Iterator[Event]:
        """The job's events as the service pushes them (Server-Sent Events), from `after`;
        reconnects with Last-Event-ID when a stream is cut, ends when the job does."""
        last = after
        while True:
            ended = False
            headers = {"Accept": "text/event-stream", "Last-Event-ID": str(last)}
            stream = self._client._http.stream(
                "GET", f"{self._path}/{job_id}/events", headers=headers,
                timeout=httpx.Timeout(30.0, read=None),
            )  # fmt: skip
            with stream as response:
                if response.status_code >= 400:
                    response.read()
                    if response.status_code in _retry.RETRY_STATUSES:
                        _retry.sleep(_retry.delay(0, response))
                        continue
                    raise _retry.error_of(response)
                for event in parse_sse(response.iter_lines()):
                    last = event.id
                    yield event
                    ended = ended or event.type in ("succeeded", "failed", "canceled")
            if ended or (self.get(job_id).done and not self._has_more(job_id, last)):
                return

    def _has_more(self, job_id: str, after: int) -> bool:
        return bool(self._client.get(f"{self._path}/{job_id}/events", after=after))


def parse_sse(lines: Iterator[str]) -> Iterator[Event]:
    """Events of a text/event-stream (id, event and data fields; comments and retry skipped)."""
    fields: dict[str, str] = {}
    for line in lines:
        if line == "":
            if "data" in fields and "id" in fields:
                data = json.loads(fields["data"])
                yield Event(
                    id=int(fields["id"]), type=fields.get("event", data.get("type", "message")),
                    data=data, created_at=data.get("created_at"),
                )  # fmt: skip
            fields = {}
            continue
        name, _, value = line.partition(":")
        if name:
            fields[name] = value.removeprefix(" ")


class Sweeps:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> Sweep:
        response = self._client.request(
            "POST", "/v1/sweeps", json=body, idempotency_key=idempotency_key, safe_to_resend=True
        )
        return Sweep.model_validate(response.json())

    def get(self, sweep_id: str) -> Sweep:
        return Sweep.model_validate(self._client.get(f"/v1/sweeps/{sweep_id}"))

    def list(self, *, limit: int = 50) -> list[Sweep]:
        return [
            Sweep.model_validate(s) for s in self._client.get("/v1/sweeps", limit=limit)["items"]
        ]

    def cancel(self, sweep_id: str) -> Sweep:
        response = self._client.request(
            "POST", f"/v1/sweeps/{sweep_id}/cancel", safe_to_resend=True
        )
        return Sweep.model_validate(response.json())

    def wait(self, sweep_id: str, *, timeout: float | None = None, poll_s: float = 2.0) -> Sweep:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (sweep := self.get(sweep_id)).done:
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"sweep {sweep_id}", sweep)
            time.sleep(poll_s)
        return sweep

    def leaderboard(self, sweep_id: str, *, format: str = "json") -> Any:
        """The leaderboard as a dict (json) or as text (csv, markdown)."""
        response = self._client.request(
            "GET", f"/v1/sweeps/{sweep_id}/leaderboard", params={"format": format}
        )
        return response.json() if format == "json" else response.text


class Artifacts:
    def __init__(self, client: Client) -> None:
        self._client = client

    def get(self, artifact_id: str) -> Artifact:
        return Artifact.model_validate(self._client.get(f"/v1/artifacts/{artifact_id}"))

    def lineage(self, artifact_id: str, *, direction: str = "ancestors") -> dict[str, Any]:
        return dict(self._client.get(f"/v1/artifacts/{artifact_id}/lineage", direction=direction))

    def delete(self, artifact_id: str) -> None:
        self._client.request("DELETE", f"/v1/artifacts/{artifact_id}", safe_to_resend=True)


class Webhooks:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self, url: str, *, events: list[str] | None = None, description: str = ""
    ) -> WebhookEndpoint:
        """The endpoint with its signing secret (shown this once). Not resent on a dropped
        connection: that could subscribe twice."""
        body: dict[str, Any] = {"url": url, "description": description}
        if events is not None:
            body["events"] = events
        response = self._client.request("POST", "/v1/webhooks", json=body, safe_to_resend=False)
        return WebhookEndpoint.model_validate(response.json())

    def list(self, *, page_size: int = 50) -> list[WebhookEndpoint]:
        """Every endpoint, oldest first (a tenant has at most the server's cap of them)."""
        return [
            WebhookEndpoint.model_validate(e)
            for e in self._client.pages("/v1/webhooks", limit=page_size)
        ]

    def delete(self, endpoint_id: str) -> None:
        self._client.request("DELETE", f"/v1/webhooks/{endpoint_id}", safe_to_resend=True)

    def rotate_secret(self, endpoint_id: str, *, overlap_s: float | None = None) -> WebhookEndpoint:
        """A new signing secret; the old one also signs for `overlap_s` seconds (default: the
        server's setting), so receivers can switch without dropping an event."""
        body = None if overlap_s is None else {"overlap_s": overlap_s}
        response = self._client.request(
            "POST", f"/v1/webhooks/{endpoint_id}/rotate-secret", json=body
        )
        return WebhookEndpoint.model_validate(response.json())

    def deliveries(
        self, endpoint_id: str, *, status: str | None = None, page_size: int = 50
    ) -> Iterator[WebhookDelivery]:
        """The endpoint's deliveries, newest first, fetched page by page as you iterate."""
        path = f"/v1/webhooks/{endpoint_id}/deliveries"
        for item in self._client.pages(path, status=status, limit=page_size):
            yield WebhookDelivery.model_validate(item)

    def replay(self, delivery_id: str) -> WebhookDelivery:
        response = self._client.request("POST", f"/v1/webhooks/deliveries/{delivery_id}/replay")
        return WebhookDelivery.model_validate(response.json())
