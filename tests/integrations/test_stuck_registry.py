"""An MLflow registry that accepts connections and then never answers, or answers one byte per
second: as the README promises for a registry that cannot be reached, the merge fails with
`mlflow_failed` (and keeps no output), within `mlflow_timeout_s` of its registration, on its
first attempt; it neither hangs nor is taken for dead."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from core.integrations import mlflow_registry
from engine.recipe import MlflowDestination
from tests.integrations.test_mlflow import swap
from tests.service.conftest import running_service
from tests.stuck_server import Mode, StuckServer


@pytest.mark.parametrize("mode", ["silent", "drip"])
def test_a_stuck_registry_fails_the_registration_in_bounded_time(
    tmp_path: Path, examples: Path, caplog: pytest.LogCaptureFixture, mode: Mode
) -> None:
    with (
        StuckServer(mode) as registry,
        running_service(
            tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
            mlflow_tracking_uri=registry.url, mlflow_timeout_s=3.0,
        ) as service,
    ):  # fmt: skip
        body = swap("stuck", mlflow={"registered_model": "m", "alias": "champion"})
        job = service.wait(service.submit(body)["id"], timeout=60)
        assert job["status"] == "failed" and job["attempts"] == 1
        assert job["error"]["code"] == "mlflow_failed"
        assert job["error"]["message"] == (
            "MLflow registry: registering m failed: the MLflow registry did not answer within 3 s"
        )
        assert any(b"/mlflow/" in request for request in registry.requests)
        assert not (service.settings.artifacts_dir / "default" / "stuck").exists()

        # A submit's check of the model's owner waits for the registry only briefly, then lets
        # the job through (registering checks again, and fails as above).
        with caplog.at_level(logging.WARNING, logger="layerswap.mlflow"):
            mlflow_registry.check_destination(
                service.settings, "default", MlflowDestination(registered_model="m")
            )
        assert any("m not checked at submit" in r.getMessage() for r in caplog.records)
