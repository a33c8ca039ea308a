"""The first requests a fresh API process answers with an evaluation in them import nothing of
lm-eval (seconds, and ~0.1 GB, on the request's path): task names are checked against the
names read from the task files and lm-eval's listed names, and a sweep past its bounds is
refused before its tasks are looked up at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.evaluation.conftest import TASK
from tests.sweeps.test_expand import BOMB

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter: the app built and started (its lifespan), the requests sent in turn, and
# after each whether lm_eval has been imported. Its executor holds the jobs queued, so that only
# the requests (no job run on a thread of the process) could have imported anything.
FRESH_PROCESS = """
import json, sys
from pathlib import Path
from fastapi.testclient import TestClient
from core.db.migrate import upgrade
from core.settings import Settings
from service.app import create_app

class Held:
    def start(self): pass
    def dispatch(self, job_id, kind): pass
    def pending(self): return set()
    def stop(self): pass

data, requests = Path(sys.argv[1]), json.loads(sys.argv[2])
settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'db.sqlite'}",
                    allowed_roots=[Path(sys.argv[3])], trusted_hosts=["testserver"])
upgrade(settings.database)
answers = []
with TestClient(create_app(settings, executor=Held())) as client:
    for path, body in requests:
        response = client.post(path, json=body)
        error = response.json().get("error") or {}
        field = error.get("details", {}).get("field")
        answers.append([response.status_code, field, "lm_eval" in sys.modules])
print(json.dumps(answers))
"""


def sweep(examples: Path, task: str, **changes: object) -> dict[str, object]:
    return {
        "task_experts": [str(examples / "math")],
        "language_experts": [str(examples / "swh")],
        "base": str(examples / "base"),
        "grid": {"bottom": [1, 2], "top": [1]},
        "evaluation": {"tasks": [task]},
        "objective": {"task": task},
        **changes,
    }


def test_requests_with_evaluations_import_nothing_of_lm_eval(
    examples: Path, tmp_path: Path
) -> None:
    merge = {"method": "layer_swap", "params": {"bottom": 1, "top": 1},
             "experts": {"task": [str(examples / "math")], "language": [str(examples / "swh")]},
             "evaluation": {"tasks": [TASK]}}  # fmt: skip
    cases = [
        # 6.3 M combinations, an unknown task: refused for its size, the tasks never looked up
        (("/v1/sweeps", sweep(examples, "mgsm_nope_xx", grid=BOMB)), (422, "budget")),
        (("/v1/sweeps", sweep(examples, TASK, grid=BOMB)), (422, "budget")),
        (("/v1/sweeps", sweep(examples, TASK)), (202, None)),
        (("/v1/sweeps", sweep(examples, "mgsm_nope_xx")), (422, "evaluation.tasks.0")),
        (("/v1/sweeps", sweep(examples, "mgsm_direct_sw")), (202, None)),  # lm-eval's own
        (("/v1/merges", merge), (202, None)),
        (("/v1/evaluations", {"source": str(examples / "math"), "evaluation": {"tasks": [TASK]}}),
         (202, None)),
    ]  # fmt: skip
    requests = json.dumps([request for request, _ in cases])
    ran = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(tmp_path), requests, str(examples)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    answers = json.loads(ran.stdout.splitlines()[-1])
    for (request, (status, field)), (got_status, got_field, imported) in zip(
        cases, answers, strict=True
    ):
        assert (got_status, got_field) == (status, field), request
        assert not imported, f"{request[0]} imported lm_eval"
