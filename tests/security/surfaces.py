"""The API's input surfaces, read from its OpenAPI spec, and how to send a value to each.

A surface is one query parameter, one path parameter, or one field of a JSON body: bodies are
walked through their schema (nested objects, array items, free-form mappings, every member of
a union), so a route, parameter or field the spec describes is a surface with no edit here. A
POST route is sent its body from BODIES with the one field replaced, so that the value reaches
past the checks of required fields; a new POST route gets a valid body there.
"""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import httpx

WALK_DEPTH = 6  # fields this deep in a body, at most
# Of a query or path value: a longer request line is refused by the HTTP server (uvicorn's h11,
# 16 KiB), before the app, in its own words.
URL_VALUE_BYTES = 2000
MISSING_ID = "0" * 32  # a path id that names nothing
# A valid body per POST route, sources under the service's allowed root (tests/service/live.py
# copies math/ and swh/ there); the webhook URL (TEST-NET-1: not public) is refused without a
# DNS lookup.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/merges": {
        "method": "layer_swap",
        "experts": {"task": ["math"], "language": ["swh"]},
        "params": {"bottom": 1, "top": 1},
    },
    "/v1/analyses": {"base": "math", "experts": [{"label": "swh", "path": "swh"}]},
    "/v1/evaluations": {"source": "math", "evaluation": {"tasks": ["arc_easy"], "limit": 1}},
    "/v1/sweeps": {
        "task_experts": ["math"],
        "language_experts": ["swh"],
        "base": "math",
        "evaluation": {"tasks": ["arc_easy"], "limit": 1},
        "objective": {"task": "arc_easy", "metric": "acc"},
    },
    "/v1/webhooks": {"url": "http://192.0.2.1:9/hook", "description": "abuse"},
    "/v1/webhooks/{endpoint_id}/rotate-secret": {"overlap_s": 0},
}


class Raw(bytes):
    """A value sent as these bytes exactly: JSON that Python's encoder would not write (nesting
    past its recursion, NaN, invalid UTF-8), or a query or path value's raw bytes."""


@dataclass(frozen=True)
class Surface:
    method: str
    path: str  # as the spec writes it: /v1/merges/{job_id}
    where: Literal["query", "path", "body"]
    name: tuple[str | int, ...]  # the parameter, or the field's path in the body
    base: dict[str, Any] | None = field(default=None, compare=False)  # the body it is set in

    @property
    def field(self) -> str:
        """The field as the service names it: dotted, as validation errors name fields."""
        return ".".join(str(part) for part in self.name)

    def __str__(self) -> str:
        return f"{self.method} {self.path} {self.where} {self.field or '(the body)'}"


def surfaces(spec: dict[str, Any]) -> list[Surface]:
    found: list[Surface] = []
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            found += [
                Surface(method.upper(), path, p["in"], (p["name"],))
                for p in operation.get("parameters", [])
                if p["in"] in ("query", "path")
            ]
            content = operation.get("requestBody", {}).get("content", {})
            if "application/json" in content:
                found.extend(body_surfaces(spec, method.upper(), path, content["application/json"]))
    return found


def body_surfaces(
    spec: dict[str, Any], method: str, path: str, content: dict[str, Any]
) -> list[Surface]:
    """Every field path of the body's schema, each set in the route's body (or, for a member
    of a union other than that body's, in a body holding just the member's tag)."""
    base = BODIES.get(path, {})
    fields: dict[tuple[str | int, ...], dict[str, Any]] = {}
    for tag, schema in union_members(spec, content["schema"]):
        member_base = base if tag == base.get("method") else {"method": tag} if tag else {}
        for name in field_paths(spec, schema, (), WALK_DEPTH):
            fields.setdefault(name, member_base)
    return [Surface(method, path, "body", name, base) for name, base in fields.items()]


def resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def union_members(
    spec: dict[str, Any], schema: dict[str, Any]
) -> list[tuple[str | None, dict[str, Any]]]:
    """Each member of the body's top-level union with its `method` (None: it has none, as a
    mergekit config), or the body's schema alone (None)."""
    schema = resolve(spec, schema)
    members = schema.get("oneOf")
    if not members:
        return [(None, schema)]
    tagged = []
    for member in (resolve(spec, m) for m in members):
        tag = member.get("properties", {}).get("method", {}).get("const")
        tagged.append((tag, member))
    return tagged


def field_paths(
    spec: dict[str, Any], schema: dict[str, Any], prefix: tuple[str | int, ...], depth: int
) -> list[tuple[str | int, ...]]:
    schema = resolve(spec, schema)
    alternatives = schema.get("anyOf") or schema.get("oneOf") or schema.get("allOf")
    if alternatives:
        return [p for a in alternatives for p in field_paths(spec, a, prefix, depth)]
    found = [prefix]
    if depth == 0:
        return found
    children: list[tuple[str | int, dict[str, Any]]] = list(schema.get("properties", {}).items())
    if isinstance(schema.get("additionalProperties"), dict):
        children.append(("x", schema["additionalProperties"]))
    if "items" in schema:
        children.append((0, schema["items"]))
    for key, child in children:
        found.extend(field_paths(spec, child, (*prefix, key), depth - 1))
    return found


def put(body: Any, name: tuple[str | int, ...], value: Any) -> Any:
    """`body` with the field at `name` set to `value` (made, with what leads to it)."""
    if not name:
        return value
    key, rest = name[0], name[1:]
    if isinstance(key, int):
        items = list(body) if isinstance(body, list) and body else [None]
        items[0] = put(items[0], rest, value)
        return items
    mapping = dict(body) if isinstance(body, dict) else {}
    mapping[key] = put(mapping.get(key), rest, value)
    return mapping


def encoded_body(body: Any) -> bytes:
    """JSON as Python writes it (\\u escapes, NaN for a float nan), Raw values spliced in."""
    raws: list[bytes] = []

    def marked(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(bytes(value))
            return f"\x01raw{len(raws) - 1}\x01"
        if isinstance(value, dict):
            return {k: marked(v) for k, v in value.items()}
        if isinstance(value, list):
            return [marked(v) for v in value]
        return value

    text = json.dumps(marked(body)).encode()
    for index, raw in enumerate(raws):
        text = text.replace(f'"\\u0001raw{index}\\u0001"'.encode(), raw)
    return text


def as_text(value: Any) -> bytes:
    """A value as a query or path parameter's bytes: strings as UTF-8 (surrogates kept, as a
    client can escape any bytes), anything else as its JSON; cut to URL_VALUE_BYTES."""
    if isinstance(value, Raw):
        text = bytes(value)
    elif isinstance(value, str):
        text = value.encode("utf-8", "surrogatepass")
    else:
        text = encoded_body(value)
    return text[:URL_VALUE_BYTES]


def send(client: httpx.Client, surface: Surface, value: Any, ids: dict[str, str]) -> httpx.Response:
    """One request with `value` at `surface`, every other path parameter an id from `ids`
    (else one naming nothing)."""
    values = {name: quote(ids.get(name, MISSING_ID), safe="") for name in path_names(surface.path)}
    query, content = "", None
    if surface.where == "path":
        values[str(surface.name[0])] = quote(as_text(value), safe="")
    elif surface.where == "query":
        query = f"?{quote(str(surface.name[0]))}={quote(as_text(value), safe='')}"
    else:
        content = encoded_body(put(copy.deepcopy(surface.base), surface.name, value))
    url = surface.path.format(**values) + query
    headers = {"content-type": "application/json"} if content is not None else {}
    return client.request(surface.method, url, content=content, headers=headers)


def path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def cursor_of(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


def problems(response: httpx.Response) -> list[str]:
    """What is wrong with an answer to anything at all: a 5xx, or an error not of the one
    shape `{"error": {"code", "message", "details"}}`."""
    status = response.status_code
    if status >= 500:
        return [f"{status}: {response.text[:300]}"]
    if status < 400:
        return []
    if not response.headers.get("content-type", "").startswith("application/json"):
        return [f"{status} answered as {response.headers.get('content-type')!r}"]
    body = response.json()
    error = body.get("error") if isinstance(body, dict) and set(body) == {"error"} else None
    if not isinstance(error, dict) or set(error) != {"code", "message", "details"}:
        return [f"{status} not of the one error shape: {response.text[:300]}"]
    if not (error["code"] and error["message"] and isinstance(error["details"], dict)):
        return [f"{status} with an empty code, message or details: {response.text[:300]}"]
    return []
