"""/ui/: the web console, static files shipped in the package (service/console/) and served
as they are: nothing is built at run time, and the pages read and write only through the JSON
API, with the key the person types in (docs/console.md).

The files are code, the same for every deployment and tenant, so they need no key; every value
the pages show comes from an API request that does. The Content-Security-Policy allows scripts,
styles and connections from this origin only, and no inline script or style: a value from the
database that slipped into the page as markup still could not run."""

from __future__ import annotations

from pathlib import Path

from starlette.datastructures import MutableHeaders
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC = Path(__file__).resolve().parent.parent / "console"
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Revalidated on every load (ETag): a new release is seen at once.
    "Cache-Control": "no-cache",
}


class SecuredFiles:
    """StaticFiles, every answer carrying HEADERS."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, with_headers)


def mount() -> Mount:
    """/ui, answering /ui/ with the console's index.html."""
    return Mount("/ui", app=SecuredFiles(StaticFiles(directory=STATIC, html=True)), name="ui")
