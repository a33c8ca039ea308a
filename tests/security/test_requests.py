"""The refusals of odd requests, answer by answer, on SQLite and on PostgreSQL alike: a cursor
this API did not make, a NUL in a query parameter or a path, a JSON body nested past the limit,
a string no store can hold, a number that is not finite, a body not in UTF-8. Each is a 4xx of
the one shape naming the field, and what the request would have made is not made."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any

import httpx
import pytest

from core.cursors import MAX_CURSOR_CHARS, decode_cursor, encode_cursor
from core.errors import InvalidRequest
from tests.security.surfaces import Raw, encoded_body, problems, surfaces
from tests.service.conftest import layer_swap
from tests.service.live import Live

DEPTH = 64  # LAYERSWAP_MAX_JSON_DEPTH's default
JSON = {"content-type": "application/json"}
BAD_CURSORS = {
    "arrays 3000 deep": b"[" * 3000,
    "arrays 10 deep": b"[" * 10 + b"]" * 10,
    "an id with a NUL": b'["2024-01-01T00:00:00+00:00", "a\\u0000b"]',
    "not a date": b'["2024-13-45T00:00:00", "0123abcd"]',
    "three parts": b'["2024-01-01T00:00:00", "a", "b"]',
    "an object": b'{"created_at": "2024-01-01T00:00:00", "id": "a"}',
    "not JSON": b"not json",
}


def cursor_of(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


def refused(response: httpx.Response, status: int = 422) -> dict[str, Any]:
    """The error's details, once checked to be `status` of the one shape."""
    assert response.status_code == status, response.text
    assert not problems(response), problems(response)
    details: dict[str, Any] = response.json()["error"]["details"]
    return details


def post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    return client.post(path, content=encoded_body(body), headers=JSON)


def newest(client: httpx.Client, path: str) -> str | None:
    """The id of the list's newest item: it changes when one is made."""
    items = client.get(path, params={"limit": 1}).json()["items"]
    return str(items[0]["id"]) if items else None


def endpoints(client: httpx.Client) -> int:
    return len(client.get("/v1/webhooks", params={"limit": 200}).json()["items"])


# --- cursors ------------------------------------------------------------------------------
def test_cursors_read_back_and_nothing_else_does() -> None:
    for created in ("2024-05-01T12:34:56.123456+00:00", "2024-05-01T12:34:56", "2024-05-01"):
        when = datetime.fromisoformat(created)
        assert decode_cursor(encode_cursor(when, "0f" * 16)) == (when, "0f" * 16)
    others = [cursor_of(raw) for raw in BAD_CURSORS.values()]
    others += ["not-base64!", "A" * (MAX_CURSOR_CHARS + 4), "WyJ4IiwgIngiXQ", "%00"]
    for cursor in others:
        with pytest.raises(InvalidRequest) as refusal:
            decode_cursor(cursor)
        assert refusal.value.details == {"field": "cursor"}, cursor


def test_every_list_turns_pages_by_its_cursors_and_refuses_others(
    loopback_service: Live, http_client: httpx.Client
) -> None:
    ids = {http_client.post("/v1/merges", json=layer_swap()).json()["id"] for _ in range(3)}
    for path in ("/v1/jobs", "/v1/merges"):
        seen: list[str] = []
        cursor: str | None = None
        for _ in range(3):
            query = {"limit": 1} | ({"cursor": cursor} if cursor else {})
            page = http_client.get(path, params=query).json()
            seen += [item["id"] for item in page["items"]]
            cursor = page["next_cursor"]
        assert set(seen) == ids, (path, seen)  # the newest three, one page each
    endpoint = post(http_client, "/v1/webhooks", {"url": "http://127.0.0.1:9/hook"})
    assert endpoint.status_code == 201, endpoint.text
    listed = {s.path for s in surfaces(loopback_service.app.openapi()) if s.name == ("cursor",)}
    assert listed == {
        "/v1/evaluations", "/v1/jobs", "/v1/merges", "/v1/webhooks",
        "/v1/webhooks/deliveries", "/v1/webhooks/{endpoint_id}/deliveries",
    }  # fmt: skip
    for path in (p.format(endpoint_id=endpoint.json()["id"]) for p in listed):
        for label, raw in BAD_CURSORS.items():
            response = http_client.get(path, params={"cursor": cursor_of(raw)})
            assert refused(response) == {"field": "cursor"}, (path, label)


# --- query strings and paths --------------------------------------------------------------
def test_a_nul_in_a_query_parameter_is_refused_naming_it(http_client: httpx.Client) -> None:
    """PostgreSQL refused the NUL in its query (a 500) and SQLite matched nothing (an empty
    page, as if the filter had been read): now both refuse it."""
    http_client.post("/v1/merges", json=layer_swap())
    named = [("/v1/jobs", "q"), ("/v1/merges", "input_artifact"),
             ("/v1/webhooks/deliveries", "subject_id"), ("/v1/jobs", "a\x00b")]  # fmt: skip
    for path, name in named:
        response = http_client.get(path, params={name: "a\x00b"})
        shown = name.replace("\x00", "\\x00")
        assert refused(response) == {"field": shown, "in": "query"}, (path, name)


def test_a_nul_in_a_path_names_nothing(http_client: httpx.Client) -> None:
    paths = [("POST", "/v1/sweeps/a%00b/cancel"), ("GET", "/v1/webhooks/a%00b"),
             ("GET", "/v1/analyses/a%00b/x"), ("DELETE", "/v1/artifacts/a%00b")]  # fmt: skip
    for method, path in paths:
        refused(http_client.request(method, path), 404)


# --- JSON bodies --------------------------------------------------------------------------
def test_a_body_nested_past_the_limit_is_refused_unparsed(
    loopback_service: Live, http_client: httpx.Client
) -> None:
    posts = [
        s.path for s in surfaces(loopback_service.app.openapi()) if s.where == "body" and not s.name
    ]
    assert len(posts) >= 6, posts
    for path in (p.format(endpoint_id="0" * 32) for p in posts):
        for body in (b"[" * 256 * 1024, b'{"a":' * 1000 + b"1" + b"}" * 1000):
            response = http_client.post(path, content=body, headers=JSON)
            assert refused(response) == {"field": "body", "limit": DEPTH}, path
            assert "nested deeper than 64" in response.json()["error"]["message"]
    # Three objects hold the arrays: 3 + (DEPTH - 2) is one too deep, 3 + (DEPTH - 3) is not.
    before = newest(http_client, "/v1/merges")
    mergekit: dict[str, Any] = {"mergekit": {"merge_method": "linear", "parameters": {}}}
    mergekit["mergekit"]["parameters"]["x"] = Raw(b"[" * (DEPTH - 2) + b"]" * (DEPTH - 2))
    response = post(http_client, "/v1/merges", mergekit)
    assert refused(response) == {"field": "body", "limit": DEPTH}, response.text
    mergekit["mergekit"]["parameters"]["x"] = Raw(b"[" * (DEPTH - 3) + b"]" * (DEPTH - 3))
    response = post(http_client, "/v1/merges", mergekit)  # at the limit: judged on its merits
    assert "nested deeper" not in response.text and response.status_code == 422, response.text
    assert newest(http_client, "/v1/merges") == before


def nul_bodies() -> list[tuple[dict[str, Any], str]]:
    """Bodies that hold what no store can, and the field each names."""
    swap = layer_swap()
    return [
        ({**swap, "output": {"name": "a\x00b"}}, "output.name"),
        ({**swap, "experts": {"task": ["math"], "language": ["sw\ud800h"]}}, "experts.language.0"),
        ({**swap, "webhook": Raw(b'"http://x/\xed\xa0\x80"')}, "webhook"),
        ({"mergekit": {"merge_method": "linear", "models": [], "a\x00": 1}}, "mergekit.a\\x00"),
        ({**swap, "params": {"bottom": float("nan"), "top": 1}}, "params.bottom"),
        ({**swap, "params": {"bottom": Raw(b"-Infinity"), "top": 1}}, "params.bottom"),
        ({"method": "soup", "models": ["math", "swh"], "params": {"weights": [Raw(b"1e999"), 1]}},
         "params.weights.0"),
    ]  # fmt: skip


def test_unstorable_text_and_non_finite_numbers_are_refused_naming_the_field(
    http_client: httpx.Client,
) -> None:
    before = newest(http_client, "/v1/merges"), endpoints(http_client)
    for body, field in nul_bodies():
        response = post(http_client, "/v1/merges", body)
        assert refused(response) == {"field": field}, response.text
        message = response.json()["error"]["message"]
        assert message.startswith(f"{field}: "), message
        assert "NUL" in message or "not a finite number" in message, message
    hook = {"url": "http://127.0.0.1:9/h", "description": "\x00"}
    description = post(http_client, "/v1/webhooks", hook)
    assert refused(description) == {"field": "description"}
    assert (newest(http_client, "/v1/merges"), endpoints(http_client)) == before


def test_a_body_not_in_utf8_is_refused(http_client: httpx.Client) -> None:
    body = json.dumps(layer_swap()).encode("utf-16")
    response = http_client.post("/v1/merges", content=body, headers=JSON)
    assert refused(response) == {"field": "body"}
    assert "UTF-8" in response.json()["error"]["message"]
