"""The HTTP edge: checks that run before routing, body parsing and authentication.

A browser on any web page can reach a service on loopback: by DNS rebinding (a name of the
attacker's that resolves to 127.0.0.1, so the Host header is the attacker's name) or by a
cross-site request (the Host is ours, the Origin is not). So the Host must be a trusted name,
any Origin must name a trusted host, and a body must be JSON (a form post, which a page may send
without asking, is not). Bodies are limited before anything reads them: by the declared
Content-Length, and for a chunked body by counting as it arrives. A query string or JSON body
that no store could hold, or nested deeper than a parser should follow (service/api/inputs.py),
is a 422 naming the field before any handler sees it; a path with a NUL names nothing (404).
"""

from __future__ import annotations

import re
from typing import NoReturn

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.settings import Settings
from service.api.errors import error_response
from service.api.inputs import body_refusal, query_refusal

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# On every answer, unless it sets its own (the console, /docs and /redoc set a policy fit for a
# page): never sniffed into another type (a JSON answer read as HTML), framed by another site,
# or named in a Referer; a JSON answer opened as a page loads and runs nothing.
SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
)


class BodyRefused(Exception):
    """Raised from `receive` to stop whoever is reading a refused body."""


# `name[:port]` or `[v6]:port`, as a Host header or an Origin's authority is written; anything
# else (userinfo, paths, spaces) names no host at all.
AUTHORITY = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::\d{1,5})?")


def host_of(authority: str) -> str | None:
    """The host, lower-case, of a Host header; None when it is not well formed."""
    found = AUTHORITY.fullmatch(authority)
    if found is None:
        return None
    return (found["v6"] or found["name"]).lower()


def origin_host(origin: str) -> str | None:
    """The host of an Origin header (`scheme://host[:port]`); None for `null` and junk."""
    scheme, separator, authority = origin.partition("://")
    return host_of(authority) if separator and scheme.isalpha() else None


def too_large(max_bytes: int) -> JSONResponse:
    return error_response(
        413,
        "request_too_large",
        f"the request body exceeds {max_bytes} bytes",
        {"field": "body", "limit": max_bytes},
    )


def bad_target(scope: Scope) -> JSONResponse | None:
    """A path holding a NUL names nothing (no id holds one): 404 before any handler could send
    it to the database. A query parameter holding what no store can: 422 naming it."""
    if "\x00" in scope["path"]:
        message = "no such resource: its path holds a NUL character"
        return error_response(404, "not_found", message, {"field": "path", "in": "path"})
    found = query_refusal(scope["query_string"])
    return None if found is None else error_response(422, "invalid_request", *found)


class BodyCheck:
    """A request's body as it arrives: counted against the size limit as it streams in, and
    a JSON one (max_depth given) checked once whole. `refusal` is the answer once refused."""

    def __init__(self, max_bytes: int, max_depth: int | None) -> None:
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self.size = 0
        self.chunks: list[bytes] = []
        self.refusal: JSONResponse | None = None

    def add(self, chunk: bytes, *, more: bool) -> None:
        """Raises BodyRefused past the limit, or at the end of a JSON body that is refused."""
        self.size += len(chunk)
        if self.size > self.max_bytes:
            self.refuse(too_large(self.max_bytes))
        if self.max_depth is None:
            return
        self.chunks.append(chunk)
        if not more:
            found = body_refusal(b"".join(self.chunks), self.max_depth)
            self.chunks.clear()
            if found is not None:
                self.refuse(error_response(422, "invalid_request", *found))

    def refuse(self, answer: JSONResponse) -> NoReturn:
        self.refusal = answer
        raise BodyRefused


def with_security_headers(send: Send) -> Send:
    """`send`, adding to the answer's start whichever SECURITY_HEADERS it does not set."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            present = {name.lower() for name, _ in headers}
            headers += [header for header in SECURITY_HEADERS if header[0] not in present]
            message["headers"] = headers
        await send(message)

    return sending


class RequestGuard:
    """Pure ASGI (no BaseHTTPMiddleware): it must see the body as a stream, as the app reads
    it, never buffered ahead of the app."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.hosts = settings.allowed_hosts
        self.max_bytes = settings.max_request_bytes
        self.max_depth = settings.max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        send = with_security_headers(send)
        refusal = self.refusal(scope, Headers(scope=scope))
        if refusal is None:
            refusal = bad_target(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.limited(scope, receive, send)

    def trusted(self, host: str | None) -> bool:
        return "*" in self.hosts or (host is not None and host in self.hosts)

    def refusal(self, scope: Scope, headers: Headers) -> JSONResponse | None:
        host = headers.get("host", "")
        if not self.trusted(host_of(host)):
            return error_response(
                400,
                "invalid_host",
                f"Host {host[:200]!r} is not a trusted name of this service "
                "(LAYERSWAP_TRUSTED_HOSTS)",
                {"field": "host", "in": "header"},
            )
        origin = headers.get("origin")
        if origin is not None and not self.trusted(origin_host(origin)):
            return error_response(
                403,
                "cross_origin",
                f"requests from the web origin {origin[:200]!r} are refused",
                {"field": "origin", "in": "header"},
            )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return too_large(self.max_bytes)
        if scope["method"] not in BODY_METHODS:
            return None
        has_body = "transfer-encoding" in headers or (declared.isdigit() and int(declared) > 0)
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if has_body and media_type != "application/json":
            return error_response(
                415,
                "unsupported_media_type",
                f"the body must be JSON sent as Content-Type: application/json "
                f"(got {media_type or 'none'!r})",
                {"field": "content-type", "in": "header"},
            )
        return None

    async def limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app, checking the body as it streams in (BodyCheck); once it is refused,
        the reader is stopped and whatever the app makes of that is replaced by the refusal."""
        json_depth = self.max_depth if scope["method"] in BODY_METHODS else None
        body = BodyCheck(self.max_bytes, json_depth)
        started = False

        async def checked_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.add(message.get("body", b""), more=message.get("more_body", False))
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if body.refusal is not None:  # the app's answer to a body it could not finish
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, checked_receive, guarded_send)
        except Exception:  # boundary: once refused, whatever the app raised becomes the refusal
            if body.refusal is None:  # BodyRefused or what the app made of it; else not ours
                raise
        if body.refusal is not None and not started:
            await body.refusal(scope, receive, send)
