"""A real MLflow tracking server (SQLite backend store) from the .venv-mlflow virtualenv that
scripts/test.sh sets up; the evaluation tests' model and data."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.distributed.conftest import free_port
from tests.evaluation.conftest import math_expert
from tests.webhooks.receiver import wait_for

__all__ = ["math_expert"]
MLFLOW = Path(__file__).resolve().parents[2] / ".venv-mlflow" / "bin" / "mlflow"


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="session")  # one per worker: both MLflow modules run on one
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert MLFLOW.exists(), f"{MLFLOW} is missing: scripts/test.sh (setup_mlflow.sh) makes it"
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )  # fmt: skip
    try:
        wait_for(lambda: _up(url) or server.poll() is not None, "the MLflow server", timeout=120)
        assert server.poll() is None, (root / "server.log").read_text()
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
