"""Evaluations through the API on the local executor: a merge that asks for one, evaluating
sources and artifacts, reuse, the comparison, the model card, failures that keep the merged
model, cancel, and refusals at submit. Scores are checked against the reference in conftest."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.io.digests import file_sha256
from tests.evaluation.conftest import (
    MAX_GEN_TOKS,
    QUESTIONS,
    TASK,
    Model,
    normalise,
    reference_answer,
)
from tests.helpers import wait_for
from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_api_lifecycle import metric

EVALUATION = {"tasks": [TASK], "num_fewshot": 0, "batch_size": 1, "max_gen_toks": MAX_GEN_TOKS,
              "dtype": "float32"}  # fmt: skip


@pytest.fixture
def service(
    tmp_path: Path, database_url: str, examples: Path, math_expert: Model
) -> Iterator[Service]:
    with running_service(tmp_path, database_url, examples, eval_data_dir=math_expert.data_dir) as s:
        yield s


def expected_accuracy(model_dir: Path, model: Model) -> float:
    """The merged model's own answers, scored against the data's targets, independently."""
    targets = [a if ok else "424242" for a, ok in zip(model.answers, model.right, strict=True)]
    answers = [reference_answer(model_dir, f"Swali: {q}\nAnswer:") for q in QUESTIONS]
    return sum(normalise(a) == normalise(t) for a, t in zip(answers, targets, strict=True)) / len(
        QUESTIONS
    )


def exact_match(scores: list[dict[str, Any]]) -> float:
    (value,) = [
        s["value"]
        for s in scores
        if s["metric"] == "exact_match" and s["filter"] == "remove_whitespace"
    ]
    return float(value)


def test_a_merge_with_an_evaluation_block_is_evaluated_and_compared(
    service: Service, math_expert: Model
) -> None:
    merge = service.submit({**layer_swap(), "evaluation": EVALUATION})
    assert merge["request"]["evaluation"]["tasks"] == [TASK]
    done = service.wait(merge["id"])
    assert done["status"] == "succeeded", done["error"]
    evaluation_id = done["result"]["evaluation"]["job_id"]
    evaluated = service.wait(evaluation_id, kind="evaluations")
    assert evaluated["status"] == "succeeded", evaluated["error"]
    assert evaluated["request"]["merge_job_id"] == merge["id"]
    output = Path(done["output"]["location"])
    assert exact_match(evaluated["result"]["scores"]) == pytest.approx(
        expected_accuracy(output, math_expert)
    )
    assert evaluated["progress"]["unit"] == "requests"
    assert evaluated["progress"]["done"] == evaluated["progress"]["total"] == len(QUESTIONS)

    # The merged model's card carries the scores; the output still verifies against its manifest.
    card = (output / "README.md").read_text(encoding="utf-8")
    front = yaml.safe_load(card.split("---\n")[1])
    (result,) = front["model-index"][0]["results"]
    assert result["task"]["name"] == TASK
    values = {m["name"]: m["value"] for m in result["metrics"]}
    assert values["exact_match (remove_whitespace, 0-shot)"] == pytest.approx(
        exact_match(evaluated["result"]["scores"])
    )
    manifest = json.loads((output / "layerswap.json").read_text())
    for name, sha in manifest["outputs"].items():
        assert file_sha256(output / name) == sha, name
    artifact = service.client.get(f"/v1/artifacts/{done['output']['artifact_id']}").json()
    files = {f["name"]: f["sha256"] for f in artifact["files"]}
    assert files["README.md"] == file_sha256(output / "README.md")

    # Evaluate both experts the same way: the merge's view compares the scores.
    for expert in ("math", "swh"):
        job = service.client.post(
            "/v1/evaluations", json={"source": expert, "evaluation": EVALUATION}
        )
        assert job.status_code == 202, job.text
        assert service.wait(job.json()["id"], kind="evaluations")["status"] == "succeeded"
    view = service.client.get(f"/v1/merges/{merge['id']}").json()
    (row,) = [
        r for r in view["result"]["evaluation"]["comparison"] if r["filter"] == "remove_whitespace"
    ]
    by_role = {i["role"]: i for i in row["inputs"]}
    assert set(by_role) == {"task", "language"}
    for role, expert in (("task", "math"), ("language", "swh")):
        entry = by_role[role]
        expected = expected_accuracy(service.checkpoints / expert, math_expert)
        assert entry["value"] == pytest.approx(expected)
        if expert == "math":
            assert expected == 0.5  # the data expects its answers on half the questions
        assert entry["difference"] == pytest.approx(row["value"] - expected)
        test = entry["paired_test"]
        assert test["documents"] == len(QUESTIONS) and 0 <= test["p_value"] <= 1
        assert entry["verdict"].startswith(("within noise", "better", "worse"))

    # Lineage shows the scores on the artifact, and the evaluation job as a descendant.
    lineage = service.client.get(
        f"/v1/artifacts/{done['output']['artifact_id']}/lineage",
        params={"direction": "descendants"},
    ).json()
    (node,) = [a for a in lineage["artifacts"] if a["id"] == done["output"]["artifact_id"]]
    assert exact_match(node["scores"]) == exact_match(evaluated["result"]["scores"])
    assert evaluation_id in {j["job_id"] for j in lineage["jobs"] if j["kind"] == "evaluation"}
    text = service.client.get("/metrics").text
    assert metric(text, 'layerswap_jobs{kind="evaluation",status="succeeded"}') == 3
    assert metric(text, 'layerswap_job_duration_seconds_count{kind="evaluation"}') == 3


def test_an_equal_evaluation_is_answered_from_stored_scores(
    service: Service, math_expert: Model
) -> None:
    body = {"source": "math", "evaluation": EVALUATION}
    first = service.wait(
        service.client.post("/v1/evaluations", json=body).json()["id"], kind="evaluations"
    )
    assert first["status"] == "succeeded" and first["result"]["ran"] == [TASK]
    samples = service.client.get(f"/v1/evaluations/{first['id']}/samples")
    assert samples.status_code == 200
    records = [json.loads(line) for line in samples.text.splitlines()]
    assert {r["doc_id"] for r in records} == set(range(len(QUESTIONS)))
    keys = {"prompt", "response", "extracted", "target", "metrics", "correct"}
    assert all(keys <= set(r) for r in records)

    second = service.wait(
        service.client.post("/v1/evaluations", json=body).json()["id"], kind="evaluations"
    )
    assert second["result"]["ran"] == []
    assert second["result"]["reused"] == [{"task": TASK, "job_id": first["id"]}]
    assert exact_match(second["result"]["scores"]) == exact_match(first["result"]["scores"])
    assert service.client.get(f"/v1/evaluations/{second['id']}/samples").status_code == 404

    other = service.wait(service.client.post(
        "/v1/evaluations", json={**body, "evaluation": {**EVALUATION, "max_gen_toks": 3}}
    ).json()["id"], kind="evaluations")  # fmt: skip
    assert other["result"]["ran"] == [TASK]  # other settings: measured again

    artifact_id = first["result"]["artifact_id"]
    listed = service.client.get(f"/v1/artifacts/{artifact_id}/evaluations").json()
    assert {e["id"] for e in listed["evaluations"]} == {first["id"], second["id"], other["id"]}
    assert len({(s["settings"]["max_gen_toks"]) for s in listed["scores"]}) == 2
    page = service.client.get("/v1/evaluations", params={"artifact_id": artifact_id}).json()
    assert [j["id"] for j in page["items"]] == [other["id"], second["id"], first["id"]]


@pytest.mark.parametrize(
    ("evaluation", "field", "code", "status"),
    [
        (
            {**EVALUATION, "tasks": [TASK, "mgsm_nope_xx"]},
            "evaluation.tasks.1",
            "unknown_task",
            422,
        ),
        ({**EVALUATION, "backend": "vllm"}, "evaluation.backend", "backend_not_offered", 422),
        ({**EVALUATION, "num_fewshot": -1}, "evaluation.num_fewshot", "invalid_request", 422),
        ({**EVALUATION, "tasks": []}, "evaluation.tasks", "invalid_request", 422),
    ],
)
def test_bad_evaluations_are_refused_at_submit_with_nothing_queued(
    service: Service, evaluation: dict[str, Any], field: str, code: str, status: int
) -> None:
    for path, body in (
        ("/v1/evaluations", {"source": "math", "evaluation": evaluation}),
        ("/v1/merges", {**layer_swap(), "evaluation": evaluation}),
    ):
        response = service.client.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code, error
        assert field in json.dumps(error), error
    assert service.client.get("/v1/evaluations").json()["items"] == []
    assert service.client.get("/v1/merges").json()["items"] == []


def test_without_lm_eval_evaluations_are_501_and_merges_still_run(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment without the `eval` extra: a None entry in sys.modules is how Python marks
    a module that cannot be imported."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    for path, body in (
        ("/v1/evaluations", {"source": "math", "evaluation": EVALUATION}),
        ("/v1/merges", {**layer_swap(), "evaluation": EVALUATION}),
    ):
        response = service.client.post(path, json=body)
        assert response.status_code == 501, response.text
        error = response.json()["error"]
        assert error["code"] == "evaluation_unavailable"
        assert "pip install 'layerswap[eval]'" in error["message"]
    merge = service.wait(service.submit(layer_swap())["id"])
    assert merge["status"] == "succeeded", merge["error"]
    assert service.client.get("/v1/evaluations").json()["items"] == []


def test_bad_targets_are_refused(service: Service) -> None:
    cases = [
        ({"evaluation": EVALUATION}, 422),
        ({"source": "math", "artifact_id": "x", "evaluation": EVALUATION}, 422),
        ({"artifact_id": "0" * 32, "evaluation": EVALUATION}, 404),
        ({"source": "no-such-model", "evaluation": EVALUATION}, 422),
        ({"source": "/etc", "evaluation": EVALUATION}, 422),
    ]
    for body, status in cases:
        response = service.client.post("/v1/evaluations", json=body)
        assert response.status_code == status, (body, response.text)


def test_a_failed_evaluation_keeps_the_merged_model(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    # No evaluation data where the task reads it: lm-eval fails, the merge stands.
    with running_service(
        tmp_path, database_url, examples, eval_data_dir=tmp_path / "none"
    ) as service:
        merge = service.wait(service.submit({**layer_swap(), "evaluation": EVALUATION})["id"])
        assert merge["status"] == "succeeded"
        evaluated = service.wait(merge["result"]["evaluation"]["job_id"], kind="evaluations")
        assert evaluated["status"] == "failed"
        assert evaluated["error"]["code"] == "evaluation_failed"
        assert "mgsm/sw/train.jsonl" in evaluated["error"]["message"]
        assert evaluated["attempts"] == 1
        output = Path(merge["output"]["location"])
        assert (output / "model.safetensors").is_file()
        again = service.client.get(f"/v1/merges/{merge['id']}").json()
        assert again["status"] == "succeeded"
        assert again["result"]["evaluation"]["status"] == "failed"


def test_a_running_evaluation_is_canceled_between_batches(
    tmp_path: Path, database_url: str, examples: Path, math_expert: Model
) -> None:
    from tests.evaluation.conftest import write_mgsm

    many = 400  # long enough to be caught running
    data = tmp_path / "eval-data"
    write_mgsm(data, ["x"] * len(QUESTIONS), [False] * len(QUESTIONS))
    test = data / "mgsm" / "sw" / "test.jsonl"
    rows = test.read_text().splitlines()
    test.write_text("\n".join(rows[i % len(rows)] for i in range(many)) + "\n")
    with running_service(tmp_path, database_url, examples, eval_data_dir=data) as service:
        job = service.client.post(
            "/v1/evaluations", json={"source": "math", "evaluation": EVALUATION}
        ).json()

        def evaluating() -> dict[str, Any] | None:
            seen = dict(service.client.get(f"/v1/evaluations/{job['id']}").json())
            assert seen["status"] in ("queued", "running"), seen
            return seen if seen["stage"] == "evaluating" and seen["progress"]["done"] > 0 else None

        seen = wait_for(evaluating, "the evaluation to be caught evaluating", 120)
        assert seen["progress"]["total"] == many
        canceled = service.client.post(f"/v1/evaluations/{job['id']}/cancel")
        assert canceled.status_code == 202
        ended = service.wait(job["id"], kind="evaluations")
        assert ended["status"] == "canceled"
        assert ended["progress"]["done"] < many
