"""The API's own words for what to do about an error (the command line has its own for the same
errors): a full disk names DELETE /v1/artifacts/{id}; a mergekit config's error names the
config's field under `mergekit.`, not the translated recipe's."""

from __future__ import annotations

import os
import pickle
import shutil
from typing import Any

from core.errors import API_ADVICE
from engine.errors import DiskFull, OutputError
from tests.service.conftest import TENANT, Service, layer_swap


def test_a_full_disk_names_the_endpoint_that_frees_space(
    service: Service, small_filesystem: Any
) -> None:
    outputs = service.settings.artifacts_dir / TENANT
    shutil.rmtree(outputs, ignore_errors=True)
    outputs.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(small_filesystem(64 * 1024), outputs)

    done = service.wait(service.submit(layer_swap())["id"])

    assert done["status"] == "failed"
    assert done["error"]["code"] == "disk_full", done["error"]
    assert done["error"]["message"].endswith(
        "; free space (DELETE /v1/artifacts/{id}) and submit again"
    )
    assert "--" not in done["error"]["message"]  # the command line's words, not the API's


def test_a_mergekit_error_names_the_configs_field(service: Service) -> None:
    one_layer = {"model": "math", "layer_range": [0, 1]}
    stacked = {"merge_method": "passthrough", "slices": [{"sources": [one_layer]}] * 300}
    response = service.client.post("/v1/merges", json={"mergekit": stacked})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["details"]["field"] == "mergekit.slices"
    assert error["message"].startswith("mergekit.slices: List should have at most 256 items")


def test_the_remedy_crosses_a_process_boundary() -> None:
    """Errors travel pickled (Celery): the remedy, and so each surface's advice, goes along."""
    sent = OutputError("out: already exists and is not empty", remedy="overwrite")
    received = pickle.loads(pickle.dumps(sent))
    assert received.remedy == "overwrite" and received.message == sent.message
    assert received.advised(API_ADVICE) == sent.message  # the service names its outputs
    full = pickle.loads(pickle.dumps(DiskFull("no space left")))
    assert full.advised(API_ADVICE) == f"no space left; {API_ADVICE['free_space']}"
