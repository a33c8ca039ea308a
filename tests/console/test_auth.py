"""The console with auth on: without a key the pages ask for one and show no data; with a
tenant's key they show that tenant's jobs only; the key stays out of URLs and cookies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver

from core.db.session import Database
from service.auth import create_key
from tests.console.browser import Page, chromium
from tests.service.conftest import layer_swap
from tests.service.live import Live, live_service
from tests.service.test_api_lifecycle import HeldExecutor

pytestmark = pytest.mark.browser


class Tenants:
    def __init__(self, live: Live) -> None:
        self.live = live
        db = Database(live.settings.database)
        self.keys = {name: create_key(db, name) for name in ("alice", "bob")}
        db.dispose()
        self.merges = {name: self.submit(name) for name in self.keys}

    def submit(self, tenant: str) -> str:
        body = {**layer_swap(), "output": {"name": f"{tenant}-secret-model"}}
        response = httpx.post(f"{self.live.url}/v1/merges", json=body,
                              headers={"Authorization": f"Bearer {self.keys[tenant]}"})  # fmt: skip
        assert response.status_code == 202, response.text
        return str(response.json()["id"])


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory, examples: Path) -> Iterator[Tenants]:
    root = tmp_path_factory.mktemp("console-auth")
    url = f"sqlite:///{root / 'layerswap.db'}"
    # Held: the jobs stay queued, which is all these pages need.
    with live_service(root, url, examples, auth=True, job_executor=HeldExecutor()) as live:
        yield Tenants(live)


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    with chromium() as chrome:
        yield chrome


@pytest.fixture
def page(driver: webdriver.Chrome, tenants: Tenants) -> Page:
    found = Page(driver, tenants.live.url)
    driver.get(f"{tenants.live.url}/ui/")
    driver.execute_script("sessionStorage.clear()")
    found.errors()  # this test's messages only
    return found


def enter_key(page: Page, key: str) -> None:
    # the prompt opens once the page's first request was refused: its field is in the page
    # before that, but cannot be typed into
    field = page.eventually(
        "the key prompt", lambda: (f := page.find("#api-key")).is_displayed() and f
    )
    field.clear()
    field.send_keys(key)
    page.find("#key-dialog button[type=submit]").click()
    page.settled()


def test_without_a_key_every_page_asks_for_one_and_shows_no_data(
    page: Page, tenants: Tenants
) -> None:
    alice = tenants.merges["alice"]
    routes = ("/jobs", f"/merges/{alice}", "/new/merge", "/new/evaluation", "/new/sweep",
              "/executor")  # fmt: skip
    for route in routes:
        page.driver.get("about:blank")  # each page loaded afresh: no prompt left open before
        page.open(route)
        page.eventually(
            lambda: f"the key prompt on {route}: {page.text()!r}",  # noqa: B023 (asked at once)
            lambda: page.find("#key-dialog").get_attribute("open") is not None,
        )
        assert alice not in page.text() and "secret-model" not in page.driver.page_source
        assert not page.all("table.jobs tbody tr") and not page.all("main form")
    page.screenshot("key-prompt")


def test_a_tenant_sees_only_its_own_jobs(page: Page, tenants: Tenants) -> None:
    page.open("/jobs")
    enter_key(page, tenants.keys["bob"])
    page.eventually("bob's jobs", lambda: page.all("table.jobs tbody tr"))
    shown = [r.get_attribute("data-job") for r in page.all("table.jobs tbody tr")]
    assert shown == [tenants.merges["bob"]]
    assert "alice" not in page.driver.page_source

    # Alice's merge, asked for by its id with Bob's key: not found, as if it did not exist.
    page.go(f"/merges/{tenants.merges['alice']}")
    assert "no such job" in page.text(".error") and "alice" not in page.text()

    # The key lives in this tab's sessionStorage only: never in the URL or a cookie.
    key = tenants.keys["bob"]
    assert page.driver.execute_script("return sessionStorage.getItem('layerswap.key')") == key
    assert key not in page.driver.current_url
    assert (
        not page.driver.get_cookies() and page.driver.execute_script("return document.cookie") == ""
    )

    page.find("#sign-out").click()  # forgotten: the prompt again, no data
    page.eventually(
        "the key prompt", lambda: page.find("#key-dialog").get_attribute("open") is not None
    )
    assert not page.all("table.jobs tbody tr")


def test_a_refused_key_asks_again(page: Page, tenants: Tenants) -> None:
    page.open("/jobs")
    enter_key(page, "lsk_not-a-key")
    page.eventually(
        "the prompt, saying the key was refused",
        lambda: "refused" in page.find("#key-dialog .why").text,
    )
    assert not page.all("table.jobs tbody tr")
