"""An unexpected error in one request adds kilobytes to the log, however deep its stack or long
its message (service/tracebacks.py): in the service's own line and in the one uvicorn adds
under `layerswap serve`'s logging."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from core.db.migrate import upgrade
from layerswap.app import build_app
from layerswap.cli.serve import serve_logging
from service.tracebacks import bounded_traceback
from tests.service.conftest import make_settings
from tests.service.live import serving

LOG_BOUND = 64 * 1024  # what one error may add to the log, with room to spare


def ping(depth: int) -> int:
    return pong(depth + 1)  # two functions in turn: Python collapses only a repeated line


def pong(depth: int) -> int:
    return ping(depth + 1)


def recursion_error() -> RecursionError:
    try:
        ping(0)
    except RecursionError as e:
        return e
    raise AssertionError("the recursion ended")


def test_a_traceback_keeps_its_ends_and_is_bounded() -> None:
    try:
        raise ValueError("x" * 500_000) from recursion_error()
    except ValueError as e:
        text = bounded_traceback(e)
    assert len(text) < LOG_BOUND, len(text)
    assert "RecursionError: maximum recursion depth exceeded" in text  # the cause, kept
    assert "frames left out)" in text and "in pong" in text and "in ping" in text
    assert "ValueError: xxxx" in text and "more)" in text  # the message, cut short
    assert text.splitlines()[-1].startswith("ValueError")  # the error itself, last as ever


def app_that_recurses(root: Path) -> FastAPI:
    """The real app (SQLite), with one more route whose handler recurses without end."""
    settings = make_settings(root, f"sqlite:///{root / 'layerswap.db'}")
    upgrade(settings.database)
    app = build_app(settings)
    app.get("/v1/recursion")(lambda: ping(0))
    return app


def test_a_requests_unexpected_error_adds_kilobytes_to_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    app = app_that_recurses(tmp_path)
    with (
        caplog.at_level(logging.ERROR, logger="layerswap.api"),
        serving(app, log_config=serve_logging()) as url,
    ):
        response = httpx.get(f"{url}/v1/recursion", timeout=30)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    (record,) = [r for r in caplog.records if r.name == "layerswap.api"]
    logged = logging.Formatter().format(record)  # as a handler writes it, traceback and all
    assert "RecursionError" in logged and "frames left out)" in logged
    assert len(logged) < LOG_BOUND, len(logged)
    uvicorn_lines = capfd.readouterr().err  # uvicorn logs the error again, to stderr
    assert "Exception in ASGI application" in uvicorn_lines, uvicorn_lines[-2000:]
    assert "RecursionError" in uvicorn_lines and "frames left out)" in uvicorn_lines
    assert len(uvicorn_lines) < LOG_BOUND, len(uvicorn_lines)
