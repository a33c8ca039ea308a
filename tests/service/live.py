"""The app served by a real uvicorn on a loopback port, in a thread: for what TestClient cannot
do (hold several streaming responses open at once, see a client hang up)."""

from __future__ import annotations

import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from core.db.migrate import upgrade
from core.jobs import Executor
from core.settings import Settings
from layerswap.app import build_app
from service.app import create_app
from tests.helpers import wait_for
from tests.service.conftest import make_settings


@dataclass
class Live:
    url: str  # http://127.0.0.1:<port>
    app: FastAPI
    settings: Settings


@contextmanager
def live_service(
    root: Path, url: str, examples: Path, *, job_executor: Executor | None = None, **overrides: Any
) -> Iterator[Live]:
    """running_service's app (examples under the allowed root, schema migrated), over HTTP."""
    settings = make_settings(root, url, **overrides)
    checkpoints = settings.source_roots[0]
    for name in ("math", "swh"):
        if not (checkpoints / name).exists():
            shutil.copytree(examples / name, checkpoints / name)
    upgrade(settings.database)
    if job_executor is None:
        app = build_app(settings)  # the executor the settings name, as `layerswap serve` has
    else:
        app = create_app(settings, executor=job_executor)
    with serving(app) as base:
        yield Live(base, app, settings)


@contextmanager
def serving(app: FastAPI, **options: Any) -> Iterator[str]:
    """Yields the base URL (`http://127.0.0.1:<port>`); stops the server on exit. `options`:
    more of uvicorn's (e.g. `layerswap serve`'s log_config)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    defaults: dict[str, Any] = {"log_level": "warning", "timeout_graceful_shutdown": 5}
    config = uvicorn.Config(app, **{**defaults, **options})
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:

        def started() -> bool:
            assert thread.is_alive(), "uvicorn exited while starting"
            return bool(server.started)

        wait_for(started, "uvicorn to start", 30, interval=0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
