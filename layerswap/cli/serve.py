"""`layerswap serve`: the API, with its executor (the `server` extra)."""

from __future__ import annotations

import copy
import errno
import os
import socket
from typing import Any

import click
import uvicorn
import uvicorn.config

from core.db.migrate import upgrade
from core.db.session import Database
from core.settings import Settings
from core.webhooks.encryption import SecretKeyError, box_for, prepare
from layerswap.app import build_app
from layerswap.cli.common import check_merge_device, fail, load_settings
from service.connections import ConnectionLimits, bounded_protocol, raise_open_files
from service.tracebacks import BoundedFormatter


@click.command()
@click.option("--host", help="Bind address (default LAYERSWAP_HOST or 127.0.0.1).")
@click.option("--port", type=int, help="Port (default LAYERSWAP_PORT or 8000).")
@click.option(
    "--workers", type=click.IntRange(1, 64), default=1, show_default=True,
    help="API processes sharing the port (more than one needs PostgreSQL).",
)  # fmt: skip
def serve(host: str | None, port: int | None, workers: int) -> None:
    """Run the HTTP API; with no configuration, on the embedded default (SQLite, in-process)."""
    settings = load_settings(host=host, port=port)
    check_port(settings)
    check_merge_device(settings)  # the in-process executor merges here
    if workers > 1 and settings.database.startswith("sqlite"):
        fail(
            "invalid_settings",
            "--workers > 1 needs PostgreSQL (LAYERSWAP_DATABASE_URL): SQLite has one writer "
            "at a time",
            2,
        )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    for root in settings.source_roots:
        root.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    check_webhook_keys(settings)
    check_open_files(settings)
    click.echo(
        f"layerswap: serving on http://{settings.host}:{settings.port} "
        f"(database {settings.database.split('@')[-1]}, executor {settings.executor}, "
        f"{workers} process{'es' if workers > 1 else ''})"
    )
    if workers == 1:
        uvicorn.run(build_app(settings), **server_options(settings))
        return
    # Each process builds its own app from the environment: pass the overrides on.
    os.environ.update(LAYERSWAP_HOST=settings.host, LAYERSWAP_PORT=str(settings.port))
    uvicorn.run(
        "layerswap.app:app_from_environment", factory=True, workers=workers,
        **server_options(settings),
    )  # fmt: skip


def check_port(settings: Settings) -> None:
    """A port another process holds stops the start in one line, before the migrations and
    the imports of the app, instead of uvicorn's "address already in use" after them."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((settings.host, settings.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                fail(
                    "port_taken",
                    f"port {settings.port} is taken (by another process); "
                    "set --port / LAYERSWAP_PORT=<another port>",
                    2,
                )
            fail("invalid_settings", f"cannot listen on {settings.host}:{settings.port}: {e}", 2)


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options, the same for one process or several: connections bounded in time and
    number (service/connections.py), and X-Forwarded-* believed only from the proxies
    LAYERSWAP_FORWARDED_ALLOW_IPS names (uvicorn would believe them from loopback by default)."""
    limits = ConnectionLimits(
        settings.header_timeout_s, settings.body_timeout_s, settings.max_connections
    )
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": "info",
        "log_config": serve_logging(),
        "http": bounded_protocol(limits),
        "limit_concurrency": settings.max_connections,
        "proxy_headers": bool(settings.forwarded_allow_ips),
        "forwarded_allow_ips": list(settings.forwarded_allow_ips),
        # A stop waits for the requests in progress this long, not for a long poll's minute
        # or an event stream's quarter of an hour: then they are cut, and the process exits.
        "timeout_graceful_shutdown": settings.stop_timeout_s,
    }


def serve_logging() -> dict[str, Any]:
    """uvicorn's logging, with each request's access line written by a plain formatter (the
    same words, no colours): uvicorn's own copies every record to colour it, which cost a
    tenth of the CPU of a page of merges. Its other lines bound their tracebacks."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["default"]["()"] = BoundedFormatter
    config["formatters"]["access"] = {"format": "%(levelname)s:     %(message)s"}
    return config


def check_open_files(settings: Settings) -> None:
    """Each connection is an open file: the process's limit is raised to hold them, and a
    limit that cannot be is said at the start, not found out under load."""
    limit, wanted = raise_open_files(settings.max_connections)
    if limit < wanted:
        click.echo(
            f"layerswap: warning: this process may open at most {limit} files; "
            f"{settings.max_connections} connections (LAYERSWAP_MAX_CONNECTIONS) and what it "
            f"opens beside them need {wanted}: raise the hard limit (ulimit -Hn) or lower "
            "LAYERSWAP_MAX_CONNECTIONS",
            err=True,
        )


def check_webhook_keys(settings: Settings) -> None:
    """Keys that cannot decrypt the stored webhook secrets stop the start in one line, before
    the API is up (its start-up would say the same under a traceback)."""
    try:
        prepare(Database(settings.database), box_for(settings))
    except SecretKeyError as e:
        fail("invalid_settings", str(e), 2)
