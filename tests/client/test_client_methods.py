"""client.methods(): GET /v1/methods through the sync and async clients, against the real
service over HTTP, typed as `Method`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.methods import METHODS
from layerswap_client import AsyncClient, Client, Method
from tests.service.live import Live, live_service


@pytest.fixture
def live(tmp_path: Path, examples: Path) -> Iterator[Live]:
    with live_service(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples) as running:
        yield running


def test_methods_sync_and_async(live: Live) -> None:
    with Client(live.url) as client:
        found = client.methods()
        answered = client.get("/v1/methods")
    assert all(isinstance(m, Method) for m in found)
    assert [m.method for m in found] == list(METHODS)
    by_name = {m.method: m for m in found}
    slerp = by_name["slerp"]
    assert slerp.params["t"]["varies_by_layer"] is True and slerp.formula
    assert slerp.mergekit is not None and "slerp" in str(slerp.mergekit)
    assert by_name["layer_swap"].mergekit is None
    assert "slices" in by_name["passthrough"].params
    assert [m.model_dump() for m in found] == answered  # nothing of the answer dropped

    async def listed() -> list[Method]:
        async with AsyncClient(live.url) as client:
            return await client.methods()

    assert [m.model_dump() for m in asyncio.run(listed())] == answered
