"""Odd input on every input surface of the API (tests/security/surfaces.py: every query
parameter, path parameter and JSON body field the OpenAPI spec describes), over HTTP on
loopback, on SQLite and on PostgreSQL.

Every surface gets every value of CATALOGUE (NUL bytes, lone surrogates, nesting past any
parser's recursion, numbers past any column, invalid UTF-8, NaN, nested JSON in base64 where a
cursor goes, ...), then Hypothesis draws more from `odd` at surfaces it picks (derandomised and
bounded: the same requests every run). Whatever is sent, the answer is never a 5xx and every
error has the one shape; a NUL or a lone surrogate in a query parameter or body field is a 422
naming exactly that field, the same on both stores.

A new kind of odd input goes in CATALOGUE (every surface gets it) or in `odd` (sampled).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.surfaces import (
    Raw,
    Surface,
    as_text,
    cursor_of,
    problems,
    send,
    surfaces,
)
from tests.service.conftest import layer_swap
from tests.service.live import Live

UNSTORABLE = ("\x00", "\ud800", "\udfff")


def arrays(depth: int) -> Raw:
    return Raw(b"[" * depth + b"]" * depth)


def objects(depth: int) -> Raw:
    return Raw(b'{"a":' * depth + b"0" + b"}" * depth)


# Every surface gets each of these (a few milliseconds a request: the suite stays fast).
CATALOGUE: dict[str, Any] = {
    "NUL": "a\x00b",
    "lone surrogate": "x\ud800",
    "arrays 3000 deep": arrays(3000),
    "invalid UTF-8": Raw(b'"\xff\xfe\xc3("'),
    "NaN": Raw(b"NaN"),
    "1e999": Raw(b"1e999"),
    "10**4000": 10**4000,
    "cursor of nested JSON": cursor_of(b"[" * 3000),
}
# More of the same kinds, for Hypothesis to draw from with its own.
MORE: list[Any] = [
    Raw(b'"\xed\xa0\x80"'),  # a lone surrogate in raw UTF-8 (JSON's parser lets it through)
    objects(100),
    arrays(40),
    Raw(b"-Infinity"),
    Raw(b"9" * 5000),  # past Python's digits for an int
    2**31, 2**63, -(2**63) - 1,
    "x" * 200_000,
    "\u202e\u0301\U0001f600\u2028\ufeff\U0010ffff",
    "../../../../etc/passwd",
    cursor_of(b'["2024-01-01T00:00:00", "a\\u0000b"]'),
    {"a": {"b": []}},
    None,
]  # fmt: skip


def known_ids(client: httpx.Client) -> dict[str, str]:
    """Ids for path parameters that name something: a merge, submitted now (held queued)."""
    submitted = client.post("/v1/merges", json=layer_swap())
    assert submitted.status_code == 202, submitted.text
    return {"job_id": submitted.json()["id"]}


def unstorable(value: Any) -> bool:
    """Whether a string of a body's `value` (a key included) holds what no stored text can."""
    if isinstance(value, str):
        return any(c in value for c in UNSTORABLE)
    if isinstance(value, Raw):
        return value.find(b"\xed\xa0\x80") >= 0  # a surrogate in raw UTF-8
    if isinstance(value, dict):
        return any(unstorable(k) or unstorable(v) for k, v in value.items())
    return isinstance(value, list) and any(unstorable(v) for v in value)


def named(response: httpx.Response, surface: Surface, value: Any) -> list[str]:
    """A NUL or lone surrogate in a body field, or a NUL in a query parameter (a query is read
    as UTF-8, its bad bytes replaced): 422 naming that field (a body field's value may name a
    field inside it). In a path, an id with one names nothing: 404, as any other."""
    if surface.where == "path":
        return []
    if not (unstorable(value) if surface.where == "body" else b"\x00" in as_text(value)):
        return []
    if response.status_code != 422:
        return [f"{response.status_code}, not 422: {response.text[:300]}"]
    details = response.json()["error"]["details"]
    if surface.where == "query" and details != {"field": surface.field, "in": "query"}:
        return [f"details {details}, not naming the query parameter"]
    if surface.where == "body" and not str(details.get("field")).startswith(surface.field):
        return [f"details {details}, not naming {surface.field or 'body'}"]
    return []


def judged(client: httpx.Client, surface: Surface, value: Any, ids: dict[str, str]) -> list[str]:
    response = send(client, surface, value, ids)
    return [f"{surface}: {p}" for p in problems(response) + named(response, surface, value)]


def test_every_surface_refuses_the_catalogue_cleanly(
    loopback_service: Live, http_client: httpx.Client
) -> None:
    found = surfaces(loopback_service.app.openapi())
    wheres = {surface.where for surface in found}
    assert wheres == {"query", "path", "body"}, wheres
    assert len(found) > 200, len(found)  # bodies walked into their nested fields
    ids = known_ids(http_client)
    failures: list[str] = []
    for surface in found:
        for label, value in CATALOGUE.items():
            failures += [
                f"{label} at {problem}" for problem in judged(http_client, surface, value, ids)
            ]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])


# --- Hypothesis: odd values of every kind, at surfaces it picks ----------------------------
odd_characters = st.sampled_from(
    ["\x00", "\ud800", "\udfff", "\u202e", "\ufeff", "\u2028", "\U0010ffff", "%", "\\", '"',
     "../", "${x}", "{{x}}", "\r\n", "\x7f", "\u0301"]
)  # fmt: skip
odd_text = st.lists(st.text(max_size=12) | odd_characters, max_size=12).map("".join)
numbers = (
    st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**4000, math.inf])
)
depths = st.integers(min_value=1, max_value=3000)
nesting = st.builds(arrays, depths) | st.builds(objects, depths)
cursors = (
    st.integers(min_value=1, max_value=3000).map(lambda depth: cursor_of(b"[" * depth))
    | st.binary(max_size=120).map(cursor_of)
    | odd_text.map(lambda text: cursor_of(text.encode("utf-8", "surrogatepass")))
)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | odd_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text, inner, max_size=3),
    max_leaves=12,
)
odd = odd_text | numbers | nesting | cursors | json_values | st.sampled_from(MORE)


def test_odd_values_anywhere_are_refused_cleanly(
    loopback_service: Live, http_client: httpx.Client
) -> None:
    found = surfaces(loopback_service.app.openapi())
    ids = known_ids(http_client)
    failures: list[str] = []

    @given(surface=st.sampled_from(found), value=odd)
    @settings(max_examples=500, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def fuzz(surface: Surface, value: Any) -> None:
        failures.extend(judged(http_client, surface, value, ids))

    fuzz()
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
