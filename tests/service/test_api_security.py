"""The HTTP edge: body limits before parsing and authentication, trusted Host and Origin
(DNS rebinding, cross-site requests), JSON-only bodies, every route but a short public list
behind a key, /metrics behind the operator's token, /readyz telling an outage from a bug."""

from __future__ import annotations

import http.client
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import func, select

from core.db.models import Job
from core.settings import Settings
from service.app import create_app
from service.auth import create_key
from tests.service.conftest import Service, layer_swap, make_settings, running_service
from tests.service.live import live_service
from tests.service.test_api_lifecycle import HeldExecutor

MiB = 1024 * 1024


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    return dict(body["error"])


def job_count(service: Service) -> int:
    with service.db.session() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def padded(size: int) -> bytes:
    """A valid merge request, padded with JSON whitespace to `size` bytes: parsed, it would be
    queued (or, without a key, refused by authentication)."""
    body = json.dumps(layer_swap()).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


@pytest.fixture
def held(tmp_path: Path, examples: Path) -> Iterator[Service]:
    """Jobs stay queued; the trusted hosts are the defaults (not the fixtures' `testserver`)."""
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    executor = HeldExecutor()
    with running_service(tmp_path, url, examples, job_executor=executor, trusted_hosts=None) as s:
        s.client.base_url = s.client.base_url.copy_with(host="localhost")
        yield s


# --- request body limit ---------------------------------------------------------------------


@pytest.mark.parametrize("auth", [False, True], ids=["no-auth", "auth-without-key"])
def test_a_declared_body_over_the_limit_is_413_before_parsing_and_auth(
    auth: bool, tmp_path: Path, examples: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, job_executor=HeldExecutor(), auth=auth) as s:
        over = s.client.post(
            "/v1/merges", content=padded(MiB + 1), headers={"content-type": "application/json"}
        )
        error = error_of(over, 413)
        assert error["code"] == "request_too_large"
        assert error["details"] == {"field": "body", "limit": MiB}
        assert job_count(s) == 0  # a parsed body would have been queued (or a 401)

        at_limit = s.client.post(
            "/v1/merges", content=padded(MiB), headers={"content-type": "application/json"}
        )
        assert at_limit.status_code == (401 if auth else 202), at_limit.text


@pytest.mark.parametrize("auth", [False, True], ids=["no-auth", "auth-without-key"])
def test_a_chunked_body_is_cut_off_at_the_limit(auth: bool, tmp_path: Path, examples: Path) -> None:
    """Real HTTP, chunked: the client sends a little more than the limit and never finishes
    the body; the answer comes anyway, so the server stopped reading at the limit."""
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    limit, chunk = 64 * 1024, 4096
    body = padded(16 * limit)
    with live_service(
        tmp_path, url, examples, job_executor=HeldExecutor(), auth=auth, max_request_bytes=limit
    ) as live:
        port = int(live.url.rsplit(":", 1)[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.putrequest("POST", "/v1/merges")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        for start in range(0, limit + 2 * chunk, chunk):
            piece = body[start : start + chunk]
            connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        response = connection.getresponse()  # no final chunk was sent: the body is unfinished
        assert response.status == 413
        error = json.loads(response.read())["error"]
        connection.close()
        assert error["code"] == "request_too_large" and error["details"]["limit"] == limit
        with live.app.state.context.db.session() as session:
            assert session.scalar(select(func.count()).select_from(Job)) == 0


# --- Host, Origin, Content-Type -------------------------------------------------------------


def test_default_trusted_hosts_are_loopback_and_a_named_bind_host(tmp_path: Path) -> None:
    assert Settings(data_dir=tmp_path).allowed_hosts == {"localhost", "127.0.0.1", "::1"}
    named = Settings(data_dir=tmp_path, host="api.internal", auth=True)
    assert "api.internal" in named.allowed_hosts
    assert Settings(data_dir=tmp_path, host="0.0.0.0", auth=True).allowed_hosts == {
        "localhost",
        "127.0.0.1",
        "::1",
    }
    assert Settings(data_dir=tmp_path, trusted_hosts=["API.example"]).allowed_hosts == {
        "api.example"
    }


def test_an_untrusted_host_is_400_before_anything_runs(held: Service) -> None:
    """DNS rebinding: the page's own name resolves to 127.0.0.1; the Host header still says it."""
    for url in ("http://localhost:8000", "http://127.0.0.1:8000", "http://[::1]:8000"):
        assert held.client.get(f"{url}/healthz").status_code == 200, url
    for url in ("http://rebind.attacker.example:8000", "http://testserver", "http://127.0.0.2"):
        error = error_of(held.client.get(f"{url}/v1/merges"), 400)
        assert error["code"] == "invalid_host"
        assert error["details"] == {"field": "host", "in": "header"}
    for host in ("evil.example@localhost", "localhost/evil", "", "localhost:port"):
        refused = held.client.get("/healthz", headers={"Host": host})
        assert error_of(refused, 400)["code"] == "invalid_host", host
    rebound = held.client.post("http://rebind.attacker.example:8000/v1/merges", json=layer_swap())
    assert error_of(rebound, 400)["code"] == "invalid_host"
    assert job_count(held) == 0


def test_star_trusts_every_host(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, trusted_hosts=["*"]) as s:
        assert s.client.get("http://anything.example/healthz").status_code == 200
        origin = {"Origin": "https://anything.example"}
        assert s.client.get("/v1/merges", headers=origin).status_code == 200


def test_a_cross_origin_request_is_403_even_without_a_body(held: Service) -> None:
    """A browser sends Origin on every cross-site POST, a body-less cancel included."""
    job = held.submit(layer_swap())
    cancel = f"/v1/merges/{job['id']}/cancel"
    for origin in ("https://evil.example", "http://localhost.evil.example", "null",
                   "http://evil.example@localhost"):  # fmt: skip
        error = error_of(held.client.post(cancel, headers={"Origin": origin}), 403)
        assert error["code"] == "cross_origin"
        assert error["details"] == {"field": "origin", "in": "header"}
    assert held.client.get(f"/v1/merges/{job['id']}").json()["status"] == "queued"
    submit = held.client.post("/v1/merges", json=layer_swap(), headers={"Origin": "null"})
    assert error_of(submit, 403)["code"] == "cross_origin"
    assert job_count(held) == 1

    same_site = held.client.post(cancel, headers={"Origin": "http://localhost:8000"})
    assert same_site.status_code == 202, same_site.text


@pytest.mark.parametrize(
    "content_type",
    ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x",
     "application/yaml", None],
)  # fmt: skip
def test_a_body_that_is_not_sent_as_json_is_415(held: Service, content_type: str | None) -> None:
    """Form-encoded and text/plain bodies are what a page may send without a CORS preflight."""
    headers = {"content-type": content_type} if content_type else {}
    response = held.client.post("/v1/merges", content=padded(2000), headers=headers)
    error = error_of(response, 415)
    assert error["code"] == "unsupported_media_type"
    assert error["details"] == {"field": "content-type", "in": "header"}
    assert job_count(held) == 0
    charset = {"content-type": "application/json; charset=utf-8"}
    assert held.client.post("/v1/merges", content=padded(2000), headers=charset).status_code == 202


# --- what answers without a key -------------------------------------------------------------

# Public, auth on or off: the probes, and the API's own description (the OpenAPI schema, its
# two UIs and the merge methods' parameters), made from the code alone: the same for every
# deployment and every tenant. Every other route, one added later included, needs a key.
PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/v1/methods"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/redoc"),
}


def every_route(app: Any) -> set[tuple[str, str]]:
    """(method, path template) of every route, those of included routers too; HEAD is
    Starlette's echo of GET."""
    return {
        (method, route.path)
        for route in iter_route_contexts(app.routes)
        if route.path is not None
        for method in (route.methods or set()) - {"HEAD"}
    }


def empty_body(method: str) -> dict[str, Any] | None:
    """A well-formed JSON body where the method takes one (a body that is not JSON is refused,
    422, before the key is asked for; `{}` reaches authentication)."""
    return {} if method in ("POST", "PUT", "PATCH", "DELETE") else None


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "0123", path)


def test_every_route_but_the_public_ones_needs_a_key(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(
        tmp_path, url, examples, auth=True, job_executor=HeldExecutor(),
        metrics_token=OPERATOR_TOKEN,
    ) as s:  # fmt: skip
        routes = every_route(s.client.app)
        assert PUBLIC.issubset(routes)
        assert {("POST", "/v1/merges"), ("GET", "/metrics")}.issubset(routes)
        for method, path in sorted(routes):
            response = s.client.request(method, concrete(path), json=empty_body(method))
            if (method, path) in PUBLIC:
                assert response.status_code == 200, (method, path, response.text[:300])
            else:
                assert error_of(response, 401)["code"] == "unauthorized", (method, path)
        # With a tenant's key none is refused for want of one: the 401s above were the key's.
        key = {"Authorization": f"Bearer {create_key(s.db, 'team-a')}"}
        for method, path in sorted(routes - OPERATOR_ONLY):
            response = s.client.request(
                method, concrete(path), headers=key, json=empty_body(method)
            )
            assert response.status_code not in (401, 403), (method, path, response.text[:300])


def test_the_public_routes_show_nothing_of_the_server(tmp_path: Path, examples: Path) -> None:
    secrets: dict[str, Any] = {
        "hub_credentials": {"team-a": {"team-a-hub-token": "hf_" + "s" * 34}},
        "metrics_token": OPERATOR_TOKEN,
        "mlflow_tracking_uri": "https://layerswap:s3cret@mlflow.internal.example",
        "broker_url": "redis://:redispw@redis.internal.example:6379/0",
    }
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, auth=True, **secrets) as s:
        for method, path in sorted(PUBLIC):
            response = s.client.request(method, path)
            assert response.status_code == 200, path
            for hidden in (str(tmp_path), "team-a-hub-token", "hf_sss", OPERATOR_TOKEN,
                           "s3cret", "mlflow.internal", "redispw", "redis.internal"):  # fmt: skip
                assert hidden not in response.text, (path, hidden)


# The whole service's figures (every tenant's work): the operator token's, not a tenant's.
OPERATOR_ONLY = {("GET", "/metrics"), ("GET", "/v1/executor")}


# --- /metrics and /readyz -------------------------------------------------------------------


OPERATOR_TOKEN = "op-" + "7" * 40


def test_metrics_need_the_operator_token_when_auth_is_on(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    """They count every tenant's jobs: a tenant's key is refused, valid or not (403, told
    apart by its prefix alone), the operator's scraper token reads them."""
    token: dict[str, Any] = {"metrics_token": OPERATOR_TOKEN}
    with running_service(tmp_path, database_url, examples, auth=True, **token) as s:
        assert error_of(s.client.get("/metrics"), 401)["code"] == "unauthorized"
        key = create_key(s.db, "team-a")
        for tenant_key in (key, "lsk_not-a-key"):
            refused = s.client.get("/metrics", headers={"Authorization": f"Bearer {tenant_key}"})
            assert error_of(refused, 403)["code"] == "forbidden"
        for wrong in (f"Bearer {OPERATOR_TOKEN}x", f"Basic {OPERATOR_TOKEN}", OPERATOR_TOKEN,
                      "Bearer " + OPERATOR_TOKEN[:-1], "Bearer"):  # fmt: skip
            refused = s.client.get("/metrics", headers={"Authorization": wrong})
            assert error_of(refused, 401)["code"] == "unauthorized", wrong
        answer = s.client.get("/metrics", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
        assert answer.status_code == 200 and "layerswap_jobs" in answer.text
        # The token reads nothing of a tenant's.
        tenant_route = s.client.get(
            "/v1/merges", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}
        )
        assert error_of(tenant_route, 401)["code"] == "unauthorized"


def test_metrics_without_a_configured_token_are_closed_with_auth_on_open_without(
    tmp_path: Path, examples: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, auth=True, job_executor=HeldExecutor()) as s:
        error = error_of(s.client.get("/metrics"), 401)
        assert "LAYERSWAP_METRICS_TOKEN" in error["message"]
        key = create_key(s.db, "team-a")
        refused = s.client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert error_of(refused, 403)["code"] == "forbidden"
    with running_service(tmp_path, url, examples, job_executor=HeldExecutor()) as s:
        assert s.client.get("/metrics").status_code == 200  # loopback, its one user


def test_a_weak_or_key_like_metrics_token_is_refused_at_start(tmp_path: Path) -> None:
    for weak in ("short", "lsk_" + "x" * 40):
        with pytest.raises(ValidationError, match="at least 32 characters") as refused:
            Settings(data_dir=tmp_path, auth=True, metrics_token=weak)
        assert weak not in str(refused.value)  # a refused secret is never echoed
    assert Settings(data_dir=tmp_path, metrics_token=OPERATOR_TOKEN).metrics_token is not None
    # the compose file passes an unset variable on as an empty one: /metrics stays closed
    assert Settings(data_dir=tmp_path, auth=True, metrics_token="").metrics_token is None


class BrokenProbeExecutor(HeldExecutor):
    """Our own executor whose broker probe has a bug (not a database error)."""

    def broker_reachable(self) -> bool:
        raise ValueError("probe bug")


def test_readyz_answers_500_for_a_bug_not_database_unavailable(
    tmp_path: Path, examples: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, job_executor=BrokenProbeExecutor()) as s:
        client = TestClient(s.client.app, raise_server_exceptions=False)
        with caplog.at_level(logging.ERROR, logger="layerswap.api"):
            error = error_of(client.get("/readyz"), 500)
        assert error["code"] == "internal_error"
        logged = [r.getMessage() for r in caplog.records if r.name == "layerswap.api"]
        assert any("Traceback" in m and "ValueError: probe bug" in m for m in logged), (
            "the bug must be logged with its traceback"
        )


def test_readyz_answers_503_when_the_database_is_down_or_not_migrated(tmp_path: Path) -> None:
    unmigrated = make_settings(tmp_path, f"sqlite:///{tmp_path / 'empty.db'}")
    nothing_listens = make_settings(
        tmp_path, "postgresql+psycopg://postgres@127.0.0.1:1/layerswap?connect_timeout=5"
    )
    for settings in (unmigrated, nothing_listens):
        app = create_app(settings, executor=HeldExecutor())
        bare = TestClient(app)  # no lifespan: start-up itself needs the database
        error = error_of(bare.get("/readyz"), 503)
        assert error["code"] == "database_unavailable"
        assert bare.get("/readyz").headers["Retry-After"] == "5"
        app.state.context.db.dispose()
