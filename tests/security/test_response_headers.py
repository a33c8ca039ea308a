"""Security headers on every answer. /docs and /redoc carry a Content-Security-Policy that allows
exactly what they load (their scripts and styles, served by the API itself, and Swagger UI's
inline start-up script by its hash) and no framing; JSON answers, refusals before routing
included, are never sniffed or framed; the console keeps its own policy. In headless Chromium
both pages render under their policies, with no network beyond the service."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.db.migrate import upgrade
from layerswap.app import build_app
from service.api.console import POLICY
from tests.console.browser import Page, chromium
from tests.service.conftest import make_settings
from tests.service.live import serving

PAGES = ("/docs", "/redoc")
LOADED = re.compile(r'<(?:script|link)\b[^>]*?\b(?:src|href)="([^"]*)"')
INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)
TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}
JSON_ANSWERS = [("GET", "/healthz", 200), ("GET", "/openapi.json", 200),
                ("GET", "/v1/merges/nope", 404), ("POST", "/v1/merges", 415)]  # fmt: skip


def app_for(root: Path) -> FastAPI:
    url = f"sqlite:///{root / 'layerswap.db'}"
    upgrade(url)
    return build_app(make_settings(root, url))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(app_for(tmp_path_factory.mktemp("headers"))) as client:
        yield client


def policy(header: str) -> dict[str, list[str]]:
    """A Content-Security-Policy as {directive: [sources]}."""
    parsed: dict[str, list[str]] = {}
    for directive in filter(None, (part.strip() for part in header.split(";"))):
        name, *sources = directive.split()
        parsed[name] = sources
    return parsed


def assert_not_sniffed_or_framed(headers: Mapping[str, str]) -> None:
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert headers["referrer-policy"] == "no-referrer"
    assert policy(headers["content-security-policy"])["frame-ancestors"] == ["'none'"]


@pytest.mark.parametrize("path", PAGES)
def test_the_reference_pages_load_only_their_own_files(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert_not_sniffed_or_framed(response.headers)
    csp = policy(response.headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"] and csp["form-action"] == ["'none'"], csp
    assert "'unsafe-inline'" not in csp["script-src"] and "'unsafe-eval'" not in csp["script-src"]
    assert not any(":" in source for source in csp["script-src"] + csp["style-src"]), csp
    loaded = LOADED.findall(response.text)
    assert loaded and all(url.startswith("/docs/assets/") for url in loaded), loaded
    for url in loaded:
        asset = client.get(url)
        assert asset.status_code == 200 and asset.content, url
        assert TYPES[Path(url).suffix] in asset.headers["content-type"], (url, asset.headers)
        assert asset.headers["x-content-type-options"] == "nosniff", url
    # Each inline script runs by its hash, and no other.
    inline = [
        f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
        for s in INLINE_SCRIPT.findall(response.text)
    ]
    assert sorted(inline) == sorted(s for s in csp["script-src"] if s.startswith("'sha256-"))


def test_every_answer_is_never_sniffed_or_framed(client: TestClient) -> None:
    """JSON answers, a refusal before routing (415) included, get the headers and a policy that
    loads nothing; a page with its own policy (the console) keeps it."""
    for method, path, status in JSON_ANSWERS:
        response = client.request(method, path, content=b"x=1" if method == "POST" else None)
        assert response.status_code == status, (path, response.text)
        assert response.headers["content-type"].startswith("application/json"), path
        assert_not_sniffed_or_framed(response.headers)
        assert policy(response.headers["content-security-policy"])["default-src"] == ["'none'"]
    console = client.get("/ui/")
    assert console.status_code == 200 and console.headers["content-security-policy"] == POLICY
    assert_not_sniffed_or_framed(console.headers)


@pytest.mark.browser
def test_the_reference_pages_render_under_their_policies(tmp_path: Path) -> None:
    with serving(app_for(tmp_path)) as base, chromium() as driver:
        page = Page(driver, base)
        driver.get(f"{base}/docs")
        page.eventually("Swagger UI to render", lambda: "Layerswap" in page.text(".info .title"))
        assert page.errors() == []
        driver.get(f"{base}/redoc")
        page.eventually("ReDoc to render", lambda: "Layerswap" in page.text("h1"))
        page.eventually("ReDoc to list the operations", lambda: "Submit Merge" in page.text("body"))
        # What the policy refuses is the one thing from elsewhere: the Redocly logo its footer
        # shows from Redocly's CDN.
        refused = page.errors()
        assert all("cdn.redoc.ly" in m["message"] for m in refused), refused
