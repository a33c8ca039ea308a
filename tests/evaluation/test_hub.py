"""The Hub and evaluations: a published merge's results reach its Hub copy (one "Add evaluation
results" commit, never a second one for the same card), and Hub models are evaluated by
`hf://` reference, pinned at submit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.evaluation.conftest import Model
from tests.evaluation.test_api import EVALUATION, exact_match
from tests.service.conftest import layer_swap, running_service
from tests.service.test_hub_api import upload

TOKEN = "hf_eval_secret_token_0123456789"


def test_results_are_committed_to_the_hub_once(
    tmp_path: Path, examples: Path, math_expert: Model, hub: Any
) -> None:
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
        eval_data_dir=math_expert.data_dir, hub_credentials={"default": {"team-a": TOKEN}},
    ) as service:  # fmt: skip
        hub_output = {"repo": "team-a/merged", "credential": "team-a"}
        body = {**layer_swap(), "evaluation": EVALUATION,
                "output": {"name": "merged", "hub": hub_output}}  # fmt: skip
        merge = service.wait(service.submit(body)["id"])
        assert merge["status"] == "succeeded", merge["error"]
        evaluated = service.wait(merge["result"]["evaluation"]["job_id"], kind="evaluations")
        assert evaluated["status"] == "succeeded", evaluated["error"]
        (commit,) = evaluated["result"]["card"]["hub_commits"]
        assert hub.head("team-a/merged") == commit
        titles = [c.title for c in hub.commits("team-a/merged")]
        assert titles.count("Add evaluation results") == 1, titles
        output = Path(merge["output"]["location"])
        remote = hub.file("team-a/merged", "README.md").decode()
        assert remote == (output / "README.md").read_text(encoding="utf-8")
        (result,) = yaml.safe_load(remote.split("---\n")[1])["model-index"][0]["results"]
        values = [m["value"] for m in result["metrics"] if "remove_whitespace" in m["name"]]
        assert values == [round(exact_match(evaluated["result"]["scores"]), 6)]
        assert (
            hub.file("team-a/merged", "layerswap.json") == (output / "layerswap.json").read_bytes()
        )

        # The same evaluation again (answered from stored scores): the card is unchanged, so
        # nothing is committed.
        again = service.client.post(
            "/v1/evaluations",
            json={"artifact_id": merge["output"]["artifact_id"], "evaluation": EVALUATION},
        )
        repeated = service.wait(again.json()["id"], kind="evaluations")["result"]
        assert repeated["reused"] and repeated["card"] == {"updated": False, "hub_commits": []}
        assert [c.title for c in hub.commits("team-a/merged")] == titles
        assert TOKEN not in service.client.get(f"/v1/evaluations/{again.json()['id']}").text


def test_a_hub_model_is_pinned_at_submit_and_evaluated(
    tmp_path: Path, examples: Path, math_expert: Model, hub: Any
) -> None:
    """The math expert uploaded to a private repo; evaluated by `hf://…@main` with the named
    credential; scored as its local copy is; a branch moved after submit changes nothing."""
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    sha = upload(hub, "team-a/math", math_expert.path, private=True)
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
        eval_data_dir=math_expert.data_dir, hub_credentials={"default": {"team-a": TOKEN}},
    ) as service:  # fmt: skip
        body = {"source": "hf://team-a/math@main", "credential": "team-a",
                "evaluation": EVALUATION}  # fmt: skip
        submitted = service.client.post("/v1/evaluations", json=body)
        assert submitted.status_code == 202, submitted.text
        assert submitted.json()["request"]["target"]["source"] == f"hf://team-a/math@{sha}"
        hub.commit("team-a/math", {"config.json": b"{}"}, message="break main")  # after submit

        done = service.wait(submitted.json()["id"], kind="evaluations")
        assert done["status"] == "succeeded", done["error"]
        assert exact_match(done["result"]["scores"]) == sum(math_expert.right) / len(
            math_expert.right
        )
        artifact = service.client.get(f"/v1/artifacts/{done['result']['artifact_id']}").json()
        assert artifact["location"] == f"hf://team-a/math@{sha}"
        assert done["result"]["card"]["updated"] is False  # not ours to rewrite
        assert TOKEN not in json.dumps(done)

        # Refused at submit: nothing queued.
        for bad, status, code in (
            ({"source": "hf://team-a/nothing-here"}, 422, "hub_repo_not_found"),
            ({"source": "hf://team-a/math@main", "credential": "nobody"}, 422,
             "unknown_credential"),
            ({"source": "hf://team-a/math@main"}, 422, "hub_repo_not_found"),  # private
            ({"source": str(math_expert.path), "credential": "team-a"}, 422, "invalid_request"),
        ):  # fmt: skip
            refused = service.client.post("/v1/evaluations", json={**bad, "evaluation": EVALUATION})
            assert refused.status_code == status, (bad, refused.text)
            assert refused.json()["error"]["code"] == code, (bad, refused.text)
        listed = service.client.get("/v1/evaluations").json()["items"]
        assert [e["id"] for e in listed] == [done["id"]]
