"""Limits on webhook endpoints: at most `webhook_max_endpoints` per tenant (a clear 409 naming
the cap, even for creations racing each other over real HTTP), and lists read page by page
with `cursor`/`limit`/`next_cursor` as /v1/merges is. Two tenants with API keys, SQLite and
PostgreSQL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from service.auth import create_key
from tests.service.conftest import Service, running_service
from tests.service.live import live_service
from tests.webhooks.conftest import FAST, announce, tenant_headers

HOOK = "http://127.0.0.1:9/hook"  # allowed by FAST; nothing needs to answer


def create(service: Service, headers: dict[str, str], n: int = 0) -> httpx.Response:
    return service.client.post("/v1/webhooks", json={"url": f"{HOOK}/{n}"}, headers=headers)


def pages(service: Service, path: str, headers: dict[str, str], limit: int) -> list[list[str]]:
    """Every page of `path`, following next_cursor; the ids on each."""
    found: list[list[str]] = []
    params: dict[str, Any] = {"limit": limit}
    while True:
        response = service.client.get(path, params=params, headers=headers)
        assert response.status_code == 200, response.text
        page = response.json()
        found.append([item["id"] for item in page["items"]])
        if page["next_cursor"] is None:
            return found
        params["cursor"] = page["next_cursor"]


def test_a_tenant_may_have_at_most_the_cap_of_endpoints(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with running_service(tmp_path, database_url, examples, auth=True, **FAST) as service:
        headers = tenant_headers(service, "a", "b")
        cap = service.settings.webhook_max_endpoints
        assert cap == 50  # the default
        made = [create(service, headers["a"], n).json()["id"] for n in range(cap)]
        refused = create(service, headers["a"], cap)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "webhook_endpoint_limit"
        assert f"{cap} webhook endpoints" in error["message"]
        assert "LAYERSWAP_WEBHOOK_MAX_ENDPOINTS = 50" in error["message"]
        assert error["details"] == {"limit": cap, "endpoints": cap}

        assert create(service, headers["b"]).status_code == 201  # each tenant has its own cap
        deleted = service.client.delete(f"/v1/webhooks/{made[0]}", headers=headers["a"])
        assert deleted.status_code == 204
        assert create(service, headers["a"], cap).status_code == 201  # a deleted one frees room
        assert create(service, headers["a"], cap + 1).status_code == 409


def test_creations_racing_each_other_stop_at_the_cap(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with live_service(
        tmp_path, database_url, examples, auth=True, webhook_max_endpoints=3, **FAST
    ) as live:
        key = create_key(live.app.state.context.db, "a")
        with httpx.Client(base_url=live.url, timeout=60) as client:

            def one(n: int) -> int:
                headers = {"Authorization": f"Bearer {key}"}
                body = {"url": f"{HOOK}/{n}"}
                return client.post("/v1/webhooks", json=body, headers=headers).status_code

            with ThreadPoolExecutor(12) as pool:
                codes = sorted(pool.map(one, range(12)))
            listed = client.get("/v1/webhooks", headers={"Authorization": f"Bearer {key}"})
    assert codes == [201] * 3 + [409] * 9
    assert len(listed.json()["items"]) == 3


def test_endpoints_and_deliveries_are_listed_page_by_page(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with running_service(tmp_path, database_url, examples, auth=True, **FAST) as service:
        headers = tenant_headers(service, "a", "b")
        made = [create(service, headers["a"], n).json()["id"] for n in range(5)]
        theirs = [create(service, headers["b"], n).json()["id"] for n in range(2)]

        listed = pages(service, "/v1/webhooks", headers["a"], limit=2)
        assert listed == [made[0:2], made[2:4], made[4:5]]  # oldest first, each once
        whole = service.client.get("/v1/webhooks", headers=headers["a"]).json()
        assert [e["id"] for e in whole["items"]] == made and whole["next_cursor"] is None
        assert pages(service, "/v1/webhooks", headers["b"], limit=1) == [[t] for t in theirs]

        # A cursor from tenant a's pages shows tenant b nothing of a's.
        first = service.client.get("/v1/webhooks", params={"limit": 1}, headers=headers["a"])
        cursor = first.json()["next_cursor"]
        crossed = service.client.get(
            "/v1/webhooks", params={"cursor": cursor}, headers=headers["b"]
        ).json()
        assert {e["id"] for e in crossed["items"]} <= set(theirs)

        for bad in ({"cursor": "nope"}, {"limit": 0}, {"limit": 201}):
            response = service.client.get("/v1/webhooks", params=bad, headers=headers["a"])
            assert response.status_code == 422, (bad, response.text)

        # One event to five endpoints: five deliveries, newest first, page by page.
        announce(service.db, "a")
        delivered = pages(service, "/v1/webhooks/deliveries", headers["a"], limit=2)
        assert [len(p) for p in delivered] == [2, 2, 1]
        assert len({d for p in delivered for d in p}) == 5
        one = pages(service, f"/v1/webhooks/{made[1]}/deliveries", headers["a"], limit=1)
        assert len(one) == 1 and len(one[0]) == 1
