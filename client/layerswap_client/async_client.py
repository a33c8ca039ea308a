"""The asynchronous client: the same resources as `Client`, awaitable (httpx.AsyncClient)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from layerswap_client import _retry
from layerswap_client.client import DEFAULT_URL, parse_sse
from layerswap_client.errors import WaitTimeout
from layerswap_client.models import Artifact, Event, Job, Method, Sweep


class AsyncClient:
    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        max_retries: int = 4,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        api_key = api_key or os.environ.get("LAYERSWAP_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_retries = max_retries
        self._http = httpx.AsyncClient(
            base_url=base_url or os.environ.get("LAYERSWAP_URL", DEFAULT_URL),
            headers={"User-Agent": "layerswap-client/0.1", **headers},
            timeout=timeout,
            transport=transport,
        )
        self.merges = AsyncJobs(self, "merges")
        self.evaluations = AsyncJobs(self, "evaluations")
        self.analyses = AsyncJobs(self, "analyses")
        self.sweeps = AsyncSweeps(self)
        self.artifacts = AsyncArtifacts(self)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        safe_to_resend: bool | None = None,
    ) -> httpx.Response:
        """As Client.request: 429/503 and (where safe) dropped connections are retried."""
        headers = {}
        if method == "POST":
            headers["Idempotency-Key"] = idempotency_key or uuid.uuid4().hex
        resend = method == "GET" if safe_to_resend is None else safe_to_resend
        params = {k: v for k, v in (params or {}).items() if v is not None}
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = await self._http.request(
                    method, path, json=json, params=params, headers=headers
                )
            except httpx.TransportError:
                if last or not resend:
                    raise
                await asyncio.sleep(_retry.delay(attempt, None))
                continue
            if response.status_code in _retry.RETRY_STATUSES and not last:
                await asyncio.sleep(_retry.delay(attempt, response))
                continue
            if response.status_code >= 400:
                raise _retry.error_of(response)
            return response
        raise AssertionError("unreachable")

    async def get(self, path: str, **params: Any) -> Any:
        return (await self.request("GET", path, params=params)).json()

    async def methods(self) -> list[Method]:
        """As Client.methods: GET /v1/methods."""
        return [Method.model_validate(m) for m in await self.get("/v1/methods")]


class AsyncJobs:
    def __init__(self, client: AsyncClient, collection: str) -> None:
        self._client, self._path = client, f"/v1/{collection}"

    async def create(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> Job:
        response = await self._client.request(
            "POST", self._path, json=body, idempotency_key=idempotency_key, safe_to_resend=True
        )
        return Job.model_validate(response.json())

    async def get(self, job_id: str) -> Job:
        return Job.model_validate(await self._client.get(f"{self._path}/{job_id}"))

    async def list(self, *, status: str | None = None, page_size: int = 50) -> AsyncIterator[Job]:
        cursor = None
        while True:
            page = await self._client.get(self._path, status=status, limit=page_size, cursor=cursor)
            for item in page["items"]:
                yield Job.model_validate(item)
            cursor = page.get("next_cursor")
            if not cursor:
                return

    async def cancel(self, job_id: str) -> Job:
        response = await self._client.request(
            "POST", f"{self._path}/{job_id}/cancel", safe_to_resend=True
        )
        return Job.model_validate(response.json())

    async def wait(self, job_id: str, *, timeout: float | None = None, poll_s: float = 1.0) -> Job:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (job := await self.get(job_id)).done:
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id}", job)
            await asyncio.sleep(poll_s)
        return job

    async def events(self, job_id: str, *, after: int = 0) -> AsyncIterator[Event]:
        """Server-Sent Events until the job ends (reconnecting with Last-Event-ID)."""
        last = after
        while True:
            ended = False
            headers = {"Accept": "text/event-stream", "Last-Event-ID": str(last)}
            async with self._client._http.stream(
                "GET", f"{self._path}/{job_id}/events", headers=headers,
                timeout=httpx.Timeout(30.0, read=None),
            ) as response:  # fmt: skip
                if response.status_code >= 400:
                    await response.aread()
                    if response.status_code in _retry.RETRY_STATUSES:
                        await asyncio.sleep(_retry.delay(0, response))
                        continue
                    raise _retry.error_of(response)
                lines = [line async for line in response.aiter_lines()]
            for event in parse_sse(iter([*lines, ""])):
                last = event.id
                yield event
                ended = ended or event.type in ("succeeded", "failed", "canceled")
            if ended or (await self.get(job_id)).done:
                return


class AsyncSweeps:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, body: dict[str, Any], *, idempotency_key: str | None = None) -> Sweep:
        response = await self._client.request(
            "POST", "/v1/sweeps", json=body, idempotency_key=idempotency_key, safe_to_resend=True
        )
        return Sweep.model_validate(response.json())

    async def get(self, sweep_id: str) -> Sweep:
        return Sweep.model_validate(await self._client.get(f"/v1/sweeps/{sweep_id}"))

    async def wait(
        self, sweep_id: str, *, timeout: float | None = None, poll_s: float = 2.0
    ) -> Sweep:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (sweep := await self.get(sweep_id)).done:
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"sweep {sweep_id}", sweep)
            await asyncio.sleep(poll_s)
        return sweep


class AsyncArtifacts:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def get(self, artifact_id: str) -> Artifact:
        return Artifact.model_validate(await self._client.get(f"/v1/artifacts/{artifact_id}"))

    async def lineage(self, artifact_id: str, *, direction: str = "ancestors") -> dict[str, Any]:
        found = await self._client.get(f"/v1/artifacts/{artifact_id}/lineage", direction=direction)
        return dict(found)
