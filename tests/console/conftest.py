"""One real service per test process, over HTTP (uvicorn in a thread), with seeded jobs made by
the real pipeline: an input expert's evaluation, a merge with its evaluation, an analysis, a
small sweep, and a merge that fails with a markup payload in its error; and one headless
Chromium per module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver

from core.db.session import Database
from tests.console.browser import Page, chromium
from tests.evaluation.conftest import TASK, Model, math_expert  # noqa: F401
from tests.evaluation.test_api import EVALUATION
from tests.helpers import wait_for
from tests.service.conftest import TERMINAL, layer_swap, make_settings
from tests.service.live import Live, live_service
from worker.examples import SWH_SCALE, make_checkpoint
from worker.executors import LocalExecutor

pytestmark = pytest.mark.browser

# A source whose name is markup: accepted at submit, gone when the merge runs, so the job's
# stored error message quotes it.
PAYLOAD = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
VANISHING = "gone" + PAYLOAD.replace("/", "|")


class VanishingExecutor(LocalExecutor):
    """The local executor, except that the checkpoint VANISHING is deleted as each job is
    handed over: a merge naming it passes the checks at submit and fails when it plans."""

    def __init__(self, root: Path, url: str, **overrides: Any) -> None:
        settings = make_settings(root, url, **overrides)
        super().__init__(Database(settings.database), settings)
        self.vanishing = settings.source_roots[0] / VANISHING

    def dispatch(self, job_id: str, kind: str) -> None:
        shutil.rmtree(self.vanishing, ignore_errors=True)
        super().dispatch(job_id, kind)


@dataclass
class Seeded:
    live: Live
    client: httpx.Client
    expert_evaluation: dict[str, Any]
    merge: dict[str, Any]
    evaluation: dict[str, Any]
    analysis: dict[str, Any]
    sweep: dict[str, Any]
    failed: dict[str, Any]

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        assert response.status_code == 200, response.text
        return response.json()


def submit(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 202, response.text
    return dict(response.json())


def wait_ended(client: httpx.Client, path: str, timeout: float = 300) -> dict[str, Any]:
    seen: list[dict[str, Any]] = [{}]

    def ended() -> dict[str, Any] | None:
        seen[0] = client.get(path).json()
        return seen[0] if seen[0].get("status") in TERMINAL else None

    return wait_for(
        ended, lambda: f"{path} to end (now {seen[0].get('status')})", timeout, interval=0.1
    )


def sweep_body() -> dict[str, Any]:
    return {
        "task_experts": ["math"],
        "language_experts": ["swh", "swh2"],
        "base": "base",
        "configurations": [{"bottom": 1, "top": 1}, {"bottom": 2, "top": 1}],
        "baselines": [{"method": "experts"}],
        "evaluation": EVALUATION,
        "objective": {"task": TASK, "metric": "exact_match", "filter": "remove_whitespace"},
    }


# One per test process, shared by the console's modules: seeding runs evaluations, a sweep and
# an analysis (a minute of CPU); the tests compare pages with the API's answers at the time, so
# the jobs other modules add do not change what they check.
@pytest.fixture(scope="session")
def seeded(
    tmp_path_factory: pytest.TempPathFactory,
    examples: Path,
    math_expert: Model,  # noqa: F811
) -> Iterator[Seeded]:
    root = tmp_path_factory.mktemp("console")
    url = f"sqlite:///{root / 'layerswap.db'}"
    overrides = {"eval_data_dir": math_expert.data_dir}
    executor = VanishingExecutor(root, url, **overrides)
    with live_service(root, url, examples, job_executor=executor, **overrides) as live:
        checkpoints = live.settings.source_roots[0]
        shutil.copytree(examples / "base", checkpoints / "base")
        make_checkpoint(checkpoints / "swh2", base=checkpoints / "base", seed=12,
                        layer_scale=SWH_SCALE, non_layer_scale=0.03)  # fmt: skip
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield seed(live, client, checkpoints)
    executor.db.dispose()


def seed(live: Live, client: httpx.Client, checkpoints: Path) -> Seeded:
    expert = submit(client, "/v1/evaluations", {"source": "math", "evaluation": EVALUATION})
    expert = wait_ended(client, f"/v1/evaluations/{expert['id']}")
    merge = submit(client, "/v1/merges", {**layer_swap(), "output": {"name": "console-merge"},
                                          "evaluation": EVALUATION})  # fmt: skip
    merge = wait_ended(client, f"/v1/merges/{merge['id']}")
    evaluation = wait_ended(client, f"/v1/evaluations/{merge['result']['evaluation_job_id']}")
    merge = client.get(f"/v1/merges/{merge['id']}").json()  # with the comparison
    analysis = submit(client, "/v1/analyses", {
        "base": "base", "experts": [{"label": "math", "path": "math"},
                                    {"label": "swh", "path": "swh"}],
        "task": "math", "language": "swh"})  # fmt: skip
    analysis = wait_ended(client, f"/v1/analyses/{analysis['id']}")
    sweep = submit(client, "/v1/sweeps", sweep_body())
    sweep = wait_ended(client, f"/v1/sweeps/{sweep['id']}", timeout=600)
    shutil.copytree(checkpoints / "swh", checkpoints / VANISHING)
    failed = submit(client, "/v1/merges", {**layer_swap(), "experts": {"task": ["math"],
                                           "language": [VANISHING]}})  # fmt: skip
    failed = wait_ended(client, f"/v1/merges/{failed['id']}")
    for job in (expert, merge, evaluation, analysis, sweep):
        assert job["status"] == "succeeded", job
    assert failed["status"] == "failed" and "<img" in failed["error"]["message"], failed
    return Seeded(live, client, expert, merge, evaluation, analysis, sweep, failed)


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    with chromium() as chrome:
        yield chrome


@pytest.fixture
def page(driver: webdriver.Chrome, seeded: Seeded) -> Iterator[Page]:
    found = Page(driver, seeded.live.url)
    yield found
    # A refused request is logged too ("the server responded with a status of 422"): the
    # tests look at what the page made of it. Script errors and CSP refusals are not.
    severe = [m for m in found.errors() if "responded with a status of 4" not in m["message"]]
    assert not severe, f"browser console errors: {severe}"
