from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation.conftest import math_expert
from tests.service.conftest import Service, database_url, running_service
from tests.webhooks.receiver import Receiver

# Loopback is where the test receiver listens; the service refuses it unless allowed.
# SQLite and PostgreSQL, as for the service tests; the evaluation tests' model and data.
__all__ = ["database_url", "math_expert"]

FAST = {
    "webhook_allowed_networks": ["127.0.0.0/8"],
    "webhook_interval_s": 0.05,
    "webhook_retry_base_s": 0.2,
    "webhook_timeout_s": 2.0,
    "public_url": "https://layerswap.example",
}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver().start()
    yield running
    running.stop()


@pytest.fixture
def service(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, database_url, examples, **FAST) as running:
        yield running


def subscribe(service: Service, receiver: Receiver, **body: Any) -> dict[str, Any]:
    response = service.client.post("/v1/webhooks", json={"url": receiver.url, **body})
    assert response.status_code == 201, response.text
    created = dict(response.json())
    receiver.secrets.append(created["secret"])
    return created
