"""The HTTP edge: checks that run before routing, body parsing and authentication.

A browser on any web page can reach a service on loopback: by DNS rebinding (a name of the
attacker's that resolves to 127.0.0.1, so the Host header is the attacker's name) or by a
cross-site request (the Host is ours, the Origin is not). So the Host must be a trusted name,
any Origin must name a trusted host, and a body must be JSON (a form post, which a page may send
without asking, is not). Bodies are limited before anything reads them: by the declared
Content-Length, and for a chunked body by counting as it arrives.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.settings import Settings
from service.api.errors import error_response

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class BodyTooLarge(Exception):
    """Raised from `receive` to stop whoever is reading a body past the limit."""


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


class RequestGuard:
    """Pure ASGI (no BaseHTTPMiddleware): it must see the body as a stream, never buffered."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.hosts = settings.allowed_hosts
        self.max_bytes = settings.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope, Headers(scope=scope))
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
            return self.too_large()
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

    def too_large(self) -> JSONResponse:
        return error_response(
            413,
            "request_too_large",
            f"the request body exceeds {self.max_bytes} bytes",
            {"field": "body", "limit": self.max_bytes},
        )

    async def limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app, counting the body as it streams in; past the limit, the reader is
        stopped and whatever the app makes of that is replaced by a 413."""
        received = 0
        exceeded = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if exceeded:  # the app's answer to a body it could not finish reading
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:  # boundary: past the limit, whatever the app raised becomes the 413
            if not exceeded:  # BodyTooLarge or what the app made of it; anything else is not ours
                raise
        if exceeded and not started:
            await self.too_large()(scope, receive, send)
