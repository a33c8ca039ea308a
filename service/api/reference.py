"""/docs (Swagger UI) and /redoc (ReDoc): the API's reference pages, served with their scripts
and styles from this origin (the files the fastapi-offline package ships, under /docs/assets),
never from a CDN: the pages load where the service has no internet access, and no third party's
script runs on this origin, beside the API key a reader types into Swagger UI.

Each page is made once and answered with a Content-Security-Policy that allows exactly what it
loads: this origin's files, and Swagger UI's one inline start-up script by its hash. ReDoc writes
its styles into the page as it renders (styled-components), so its page allows inline styles;
neither page allows any other script, connection, frame or form target, and no site may frame
them."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Awaitable, Callable
from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

ASSETS = "/docs/assets"
STATIC = Path(str(files("fastapi_offline") / "static"))
INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)
COMMON = (
    "default-src 'none'; connect-src 'self'; img-src 'self' data:; font-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def install(app: FastAPI) -> None:
    """/docs, /redoc and their files; the app must be made with docs_url and redoc_url None."""
    swagger, redoc = pages(app.title, app.openapi_url or "/openapi.json")
    swagger_policy = f"script-src 'self' {inline_scripts(swagger)}; style-src 'self'"
    # ReDoc runs its search in a worker it makes from a blob.
    redoc_policy = "script-src 'self'; style-src 'self' 'unsafe-inline'; worker-src blob:"
    app.add_route("/docs", page(swagger, swagger_policy), include_in_schema=False)
    app.add_route("/redoc", page(redoc, redoc_policy), include_in_schema=False)
    app.router.routes.append(Mount(ASSETS, app=StaticFiles(directory=STATIC), name="docs-assets"))


def pages(title: str, openapi_url: str) -> tuple[bytes, bytes]:
    """FastAPI's two pages, pointed at the files under ASSETS."""
    swagger = get_swagger_ui_html(
        openapi_url=openapi_url,
        title=f"{title} - Swagger UI",
        swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS}/favicon.png",
        oauth2_redirect_url=None,  # keys are bearer tokens: no OAuth2 flow to come back from
        # Swagger UI would send the schema's address to its public validator for a badge.
        swagger_ui_parameters={"validatorUrl": None},
    )
    redoc = get_redoc_html(
        openapi_url=openapi_url,
        title=f"{title} - ReDoc",
        redoc_js_url=f"{ASSETS}/redoc.standalone.js",
        redoc_favicon_url=f"{ASSETS}/favicon.png",
        with_google_fonts=False,
    )
    return bytes(swagger.body), bytes(redoc.body)


def inline_scripts(html: bytes) -> str:
    """The CSP sources that allow exactly the page's inline scripts."""
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'"
        for script in INLINE_SCRIPT.findall(html.decode())
    )


def page(html: bytes, policy: str) -> Callable[[Request], Awaitable[Response]]:
    headers = {"Content-Security-Policy": f"{policy}; {COMMON}"}

    async def answer(_: Request) -> Response:
        return Response(html, media_type="text/html; charset=utf-8", headers=headers)

    return answer
