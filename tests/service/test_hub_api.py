"""Hub sources and destinations through the API, against the suite's Hub-compatible server
(tests/hub/server.py) with the real huggingface_hub client: pinning at submit, partial fetches,
publishing with a model card, idempotent commits, every error, and no token anywhere."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from sqlalchemy import select, text

from core.db.models import Artifact, Job, JobEvent
from tests.reference import load
from tests.service.conftest import Service, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from worker.pipeline import run_job

TOKEN = "hf_team_a_secret_token_0123456789"
LAYERS = 6


@pytest.fixture(scope="session")
def sharded_family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/math/swh with one shard per layer or so, so a layer swap needs only some."""
    from worker.examples import MATH_SCALE, SWH_SCALE, make_checkpoint

    root = tmp_path_factory.mktemp("sharded")
    base = make_checkpoint(root / "base", layers=LAYERS, seed=0, shard_size="80KB")
    for name, seed, scale in (("math", 1, MATH_SCALE), ("swh", 2, SWH_SCALE)):
        make_checkpoint(
            root / name, base=base, seed=seed, layer_scale=scale, shard_size="80KB"
        )  # fmt: skip
    return root


def upload(hub: Any, repo: str, directory: Path, **create: Any) -> str:
    hub.create_repo(repo, **create)
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    return str(hub.commit(repo, files, message=f"upload {directory.name}"))


@pytest.fixture
def experts(hub: Any, sharded_family: Path) -> dict[str, str]:
    """org/math and org/swh public; team-a/private-math private; org/gated gated."""
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    return {
        "math": upload(hub, "org/math", sharded_family / "math"),
        "swh": upload(hub, "org/swh", sharded_family / "swh"),
        "private": upload(hub, "team-a/private-math", sharded_family / "math", private=True),
        "gated": upload(hub, "org/gated", sharded_family / "math", gated=True),
    }


@pytest.fixture
def service(tmp_path: Path, examples: Path) -> Iterator[Service]:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(
        tmp_path, url, examples, hub_credentials={"default": {"team-a": TOKEN}}
    ) as running:
        yield running


def swap(
    task: str = "hf://org/math@main", language: str = "hf://org/swh", **extra: Any
) -> dict[str, Any]:
    return {
        "method": "layer_swap",
        "experts": {"task": [task], "language": [language]},
        "params": {"bottom": 1, "top": 1, "non_layer": "language"},
        **extra,
    }


def to_hub(repo: str = "team-a/merged", **extra: Any) -> dict[str, Any]:
    return {"name": "merged", "hub": {"repo": repo, "credential": "team-a", **extra}}


# --- end to end ---------------------------------------------------------------------------


def test_layer_swap_from_the_hub_to_the_hub(
    service: Service, hub: Any, experts: dict[str, str], sharded_family: Path, tmp_path: Path
) -> None:
    job = service.submit(swap(output=to_hub()))
    assert [(s["repo"], s["revision"], s["sha"]) for s in job["sources"]] == [
        ("org/math", "main", experts["math"]),
        ("org/swh", "main", experts["swh"]),
    ]
    assert job["request"]["experts"]["task"] == [f"hf://org/math@{experts['math']}"]

    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]

    # One commit on the destination, naming the job, holding exactly the local output.
    commits = hub.commits("team-a/merged")
    assert len(commits) == 2  # the repository's initial commit, then ours
    assert job["id"] in commits[0].title
    published = done["output"]["published"]
    assert published == [done["result"]["published"]]
    assert published[0]["commit"] == commits[0].oid == hub.head("team-a/merged")
    remote = hub.files("team-a/merged")
    out_dir = service.settings.artifacts_dir / "default" / "merged"
    local = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local

    # The merged tensors are the layer swap of the experts' tensors (independent reference).
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    for name, data in remote.items():
        (pulled / name).write_bytes(data)
    merged, math, swh = load(pulled), load(sharded_family / "math"), load(sharded_family / "swh")
    for name, tensor in merged.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        source = math if layer is not None and 1 <= layer < LAYERS - 1 else swh
        assert torch.equal(tensor, source[name]), name

    # It loads with transformers and runs.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(pulled))
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()

    # The card: front matter with the inputs, a body with the commits and per-layer table.
    _, front_matter, body = remote["README.md"].decode().split("---\n", 2)
    front = yaml.safe_load(front_matter)
    assert front["base_model"] == ["org/math", "org/swh"]
    assert front["base_model_relation"] == "merge"
    assert {"merge", "layer-swapping"} <= set(front["tags"])
    assert front["library_name"] == "transformers"
    assert experts["math"] in body and experts["swh"] in body
    assert body.count("| transition") + body.count("| task") + body.count("| language") >= LAYERS
    manifest = json.loads(remote["layerswap.json"])
    assert manifest["job"]["id"] == job["id"]
    assert {i["source"] for i in manifest["inputs"]} == {
        f"hf://org/math@{experts['math']}",
        f"hf://org/swh@{experts['swh']}",
    }

    # Lineage shows the pinned inputs.
    lineage = service.client.get(
        f"/v1/artifacts/{done['output']['artifact_id']}/lineage", params={"direction": "ancestors"}
    ).json()
    locations = {a["location"] for a in lineage["artifacts"]}
    assert f"hf://org/math@{experts['math']}" in locations
    assert f"hf://org/swh@{experts['swh']}" in locations
    artifact = service.client.get(f"/v1/artifacts/{done['output']['artifact_id']}").json()
    assert artifact["published"] == published

    # Download progress was part of the job's progress.
    events = service.client.get(f"/v1/merges/{job['id']}/events").json()
    assert any(e["type"] == "progress" and e["data"]["stage"] == "downloading" for e in events)


def shard_layout(path: Path) -> tuple[int, dict[str, slice]]:
    """(bytes before the tensor data, {tensor: where its bytes are in the file}) read from a
    safetensors header."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    start = 8 + length
    return start, {
        k: slice(start + v["data_offsets"][0], start + v["data_offsets"][1])
        for k, v in header.items()
    }


def read_by_swap(expert: str, tensor: str, bottom: int = 1, top: int = 1) -> bool:
    """Whether swap() (non-layer tensors from the language expert) reads `tensor` of
    `expert`: the task expert's layers bottom..LAYERS-top-1, the language expert's rest."""
    match = re.match(r"model\.layers\.(\d+)\.", tensor)
    middle = match is not None and bottom <= int(match.group(1)) < LAYERS - top
    return middle == (expert == "math")


def assert_views_hold_what_the_swap_reads(fetched: Any, family: Path) -> None:
    """Every shard a fetch's views show has the original's header and, of every tensor swap()
    reads, the original's bytes."""
    for source, view in fetched.directories.items():
        expert = "math" if "math" in source else "swh"
        for shard in (family / expert).glob("*.safetensors"):
            header, tensors = shard_layout(shard)
            original, seen = shard.read_bytes(), (view / shard.name).read_bytes()
            assert seen[:header] == original[:header], shard.name
            for name, part in tensors.items():
                if read_by_swap(expert, name):
                    assert seen[part] == original[part], (shard.name, name)


def test_a_layer_swap_fetches_only_the_bytes_of_the_tensors_it_reads(
    service: Service, hub: Any, experts: dict[str, str], sharded_family: Path
) -> None:
    done = service.wait(service.submit(swap(output={"name": "ranged"}))["id"])
    assert done["status"] == "succeeded", done["error"]
    kinds = set()
    fetched = used = shards_holding_used = 0
    for repo, expert in (("org/math", "math"), ("org/swh", "swh")):
        for shard in sorted((sharded_family / expert).glob("*.safetensors")):
            header, tensors = shard_layout(shard)
            read = sum(p.stop - p.start for t, p in tensors.items() if read_by_swap(expert, t))
            size = shard.stat().st_size
            if read == size - header:  # all of it: downloaded whole, after its header
                expected, kind = header + size, "whole"
            else:  # its header, then only the tensors read (none: the header alone)
                expected, kind = header + read, "ranges" if read else "header"
            kinds.add(kind)
            assert hub.bytes_served(repo, shard.name) == expected, (repo, shard.name, kind)
            fetched += expected
            used += read
            shards_holding_used += size if read else 0
        assert hub.bytes_served(repo, "config.json") > 0
    assert kinds == {"whole", "ranges", "header"}  # the fixture exercises all three
    assert fetched < shards_holding_used  # less than whole shards would have been
    ranges = [r for r in hub.requests if r.method == "GET" and r.range and r.status == 206]
    assert len(ranges) < 3 * 2 * 7, "adjacent tensors are fetched in one range"

    # The merged model is the one computed from fully downloaded experts.
    math, swh = load(sharded_family / "math"), load(sharded_family / "swh")
    merged = load(service.settings.artifacts_dir / "default" / "ranged")
    for name, tensor in merged.items():
        expected_tensor = math[name] if read_by_swap("math", name) else swh[name]
        assert torch.equal(tensor, expected_tensor), name


def test_a_sparsifying_merge_fetches_the_base_it_takes_deltas_from(
    service: Service, hub: Any, experts: dict[str, str], sharded_family: Path, tmp_path: Path
) -> None:
    """dare_ties reads the base's every tensor as well as the models': the fetch gets its
    ranges too, and the output equals the same merge of local copies."""
    from engine.merge import MergeOptions, merge
    from engine.recipe import parse_recipe

    upload(hub, "org/base", sharded_family / "base")
    params = {"density": 0.5, "weights": [1.0, 0.7], "seed": 5}
    recipe = {"method": "dare_ties", "base": "hf://org/base",
              "models": ["hf://org/math", "hf://org/swh"], "params": params,
              "output": {"name": "dare"}}  # fmt: skip
    done = service.wait(service.submit(recipe)["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["result"]["resolved_weights"] == {"models": [1.0, 0.7], "seed": 5}
    for shard in (sharded_family / "base").glob("*.safetensors"):
        assert hub.bytes_served("org/base", shard.name) > shard_layout(shard)[0], shard.name
    local = {**recipe, "base": str(sharded_family / "base"), "output": {},
             "models": [str(sharded_family / m) for m in ("math", "swh")]}  # fmt: skip
    merge(
        parse_recipe(local), tmp_path / "local", resolve=Path, options=MergeOptions(durable=False)
    )
    expected, merged = (
        load(tmp_path / "local"),
        load(service.settings.artifacts_dir / "default" / "dare"),
    )
    assert merged.keys() == expected.keys()
    for name, tensor in merged.items():
        assert torch.equal(tensor, expected[name]), name


def test_aligned_vocabularies_fetch_the_rows_they_fill_from(
    service: Service, hub: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tokenizer_source names a Hub source (still matching once pinned); the output's head
    and embedding are the language expert's rows aligned to the task expert's vocabulary,
    which fill the chat tokens it lacks from the task expert's rows: those are fetched too,
    though the task expert is not a term of those tensors."""
    from tests.engine.vocabularies import aligned, make_chat_family, vocabulary

    fam = make_chat_family(tmp_path_factory.mktemp("vocab"), dtype=torch.bfloat16)
    upload(hub, "org/chat", fam.chat)
    upload(hub, "org/tool", fam.tool)
    recipe = {
        "method": "layer_swap",
        "experts": {"task": ["hf://org/chat"], "language": ["hf://org/tool"]},
        "params": {"bottom": 1, "top": 0, "non_layer": "language"},
        "tokenizer_source": "hf://org/chat",
        "output": {"name": "vocab"},
    }
    done = service.wait(service.submit(recipe)["id"])
    assert done["status"] == "succeeded", done["error"]
    out = service.settings.artifacts_dir / "default" / "vocab"
    merged, output = load(out), vocabulary(out)
    assert output == vocabulary(fam.chat)
    chat, tool = load(fam.chat), load(fam.tool)
    vocabularies = [vocabulary(fam.chat), vocabulary(fam.tool)]
    for name, tensor in merged.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            expected = aligned(output, vocabularies, [chat[name], tool[name]], base=None)[1]
        else:
            expected = chat[name] if name.startswith("model.layers.1.") else tool[name]
        assert torch.equal(tensor, expected), name


def test_a_passthrough_of_hub_sources_is_pinned_slices_included(
    service: Service, experts: dict[str, str], sharded_family: Path
) -> None:
    """Pinning renames every mention of a source: the slices name the models too."""
    math, swh = "hf://org/math@main", "hf://org/swh"
    slices = [{"sources": [{"model": math, "layer_range": [0, 2]}]},
              {"sources": [{"model": swh, "layer_range": [1, 3]}]}]  # fmt: skip
    job = service.submit({"method": "passthrough", "models": [math, swh],
                          "params": {"slices": slices}})  # fmt: skip
    pinned = [f"hf://org/math@{experts['math']}", f"hf://org/swh@{experts['swh']}"]
    assert job["request"]["models"] == pinned
    named = [s["sources"][0]["model"] for s in job["request"]["params"]["slices"]]
    assert named == pinned
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    out = load(service.settings.artifacts_dir / "default" / done["output"]["name"])
    swh_layers = load(sharded_family / "swh")
    name = "model.layers.{}.mlp.up_proj.weight"
    assert torch.equal(out[name.format(2)], swh_layers[name.format(1)])  # output 2 = swh's 1


def test_a_second_job_reuses_the_cache(service: Service, hub: Any, experts: dict[str, str]) -> None:
    assert service.wait(service.submit(swap())["id"])["status"] == "succeeded"
    hub.clear_requests()
    assert service.wait(service.submit(swap())["id"])["status"] == "succeeded"
    downloads = [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert downloads == [], [r.path for r in downloads]


def test_a_branch_moved_after_submit_changes_nothing(
    tmp_path: Path, examples: Path, hub: Any, experts: dict[str, str], sharded_family: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, job_executor=HeldExecutor()) as service:
        job = service.submit(swap())
        # main moves on: new weights in every shard of org/math
        moved = {
            p.name: p.read_bytes()[:-2] + b"\x00\x00"
            for p in (sharded_family / "swh").glob("*.safetensors")
        }
        hub.commit("org/math", moved, message="retrained")
        assert hub.head("org/math") != experts["math"]
        run_job(job["id"], db=service.db, settings=service.settings)
        done = service.client.get(f"/v1/merges/{job['id']}").json()
    assert done["status"] == "succeeded", done["error"]
    out_dir = service.settings.artifacts_dir / "default" / done["output"]["name"]
    merged, math = load(out_dir), load(sharded_family / "math")
    assert torch.equal(
        merged["model.layers.2.mlp.up_proj.weight"], math["model.layers.2.mlp.up_proj.weight"]
    )
    manifest = json.loads((out_dir / "layerswap.json").read_text())
    assert manifest["inputs"][0]["source"] == f"hf://org/math@{experts['math']}"


# --- private and gated, credentials, and no token anywhere ----------------------------------


def test_private_sources_need_the_named_credential(
    service: Service, experts: dict[str, str]
) -> None:
    private = "hf://team-a/private-math"
    refused = service.client.post("/v1/merges", json=swap(task=private))
    assert refused.status_code == 422
    assert refused.json()["error"]["code"] == "hub_repo_not_found"
    job = service.submit(swap(task=private, credential="team-a"))
    assert service.wait(job["id"])["status"] == "succeeded"


def test_gated_sources_without_access_are_refused(
    service: Service, experts: dict[str, str]
) -> None:
    response = service.client.post(
        "/v1/merges", json=swap(task="hf://org/gated", credential="team-a")
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "hub_gated"


def test_unknown_credential_names_are_refused(service: Service, experts: dict[str, str]) -> None:
    for body in (swap(credential="nobody"), swap(output=to_hub(credential="nobody"))):
        response = service.client.post("/v1/merges", json=body)
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["code"] == "unknown_credential" and "nobody" in error["message"]
        assert TOKEN not in response.text
        assert "team-a" not in response.text, "the configured names are not listed"


def test_a_tenant_uses_only_its_own_credentials(
    tmp_path: Path, examples: Path, hub: Any, experts: dict[str, str]
) -> None:
    from service.auth import create_key

    credentials = {"a": {"team-a": TOKEN}, "b": {"own": "hf_b_own_token"}}
    url = f"sqlite:///{tmp_path / 'tenants.db'}"
    with running_service(tmp_path, url, examples, auth=True, hub_credentials=credentials) as svc:
        key_a, key_b = create_key(svc.db, "a"), create_key(svc.db, "b")
        private = swap(task="hf://team-a/private-math", credential="team-a")
        refused = []
        for body in (private, swap(credential="nobody"), swap(output=to_hub())):
            response = svc.client.post(
                "/v1/merges", json=body, headers={"Authorization": f"Bearer {key_b}"}
            )
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["code"] == "unknown_credential"
            assert "own" not in error["message"] and TOKEN not in response.text
            refused.append(error["message"].replace("nobody", "team-a"))
        # Another tenant's name reads exactly like a name nobody has.
        assert refused[0] == refused[1]
        assert error["details"]["field"] == "output.hub.credential"
        assert not any(r.token == TOKEN for r in hub.requests), "b's requests never used a's"

        accepted = svc.client.post(
            "/v1/merges", json=private, headers={"Authorization": f"Bearer {key_a}"}
        )
        assert accepted.status_code == 202, accepted.text
        assert any(r.token == TOKEN for r in hub.requests), "tenant a's own credential was used"


def test_the_flat_credentials_form_is_refused_at_start_without_echoing_tokens(
    tmp_path: Path,
) -> None:
    flat = json.dumps({"team-a": "hf_flat_secret"})
    result = cli(tmp_path, "serve", "--port", "1", LAYERSWAP_HUB_CREDENTIALS=flat)
    assert result.returncode == 2
    assert "error [invalid_settings]: hub_credentials:" in result.stderr
    assert '{"<tenant>": {"<name>": "hf_..."}}' in result.stderr
    assert "hf_flat_secret" not in result.stdout + result.stderr


def test_the_token_appears_nowhere(
    service: Service, hub: Any, experts: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    hub.fail_commits(1, mode="lost_response")  # an error path too, with its log lines
    job = service.submit(
        swap(task="hf://team-a/private-math", credential="team-a", output=to_hub())
    )
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert any(r.token == TOKEN for r in hub.requests), "the credential was used"
    seen = [service.client.get(f"/v1/merges/{job['id']}").text]
    seen.append(service.client.get(f"/v1/merges/{job['id']}/events").text)
    seen.append(service.client.get("/v1/merges").text)
    seen.append(service.client.get(f"/v1/artifacts/{done['output']['artifact_id']}/lineage").text)
    seen += [r.getMessage() for r in caplog.records]
    with service.db.session() as session:
        for table in ("jobs", "job_events", "artifacts", "lineage_edges", "tenants", "api_keys"):
            seen += [repr(tuple(row)) for row in session.execute(text(f"SELECT * FROM {table}"))]
    out_dir = service.settings.artifacts_dir / "default" / "merged"
    seen += [p.read_text(errors="replace") for p in out_dir.iterdir() if p.suffix != ".safetensors"]
    leaks = [s for s in seen if TOKEN in s]
    assert not leaks, leaks[:1]


# --- errors at submit ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "status", "code"),
    [
        ("hf://org/nothing-here", 422, "hub_repo_not_found"),
        ("hf://org/math@no-such-branch", 422, "hub_revision_not_found"),
        ("hf://org/math@" + "0" * 40, 422, "hub_revision_not_found"),
        ("hf://org", 422, "invalid_request"),
        ("hf://org/math@", 422, "invalid_request"),
    ],
)
def test_submit_time_errors(
    service: Service, experts: dict[str, str], task: str, status: int, code: str
) -> None:
    response = service.client.post("/v1/merges", json=swap(task=task))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["details"]["field"] == "experts.task.0"
    with service.db.session() as session:
        assert session.scalars(select(Job)).all() == []  # nothing queued


def test_pickle_only_repositories_are_refused_with_advice(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    hub.create_repo("org/pickled")
    hub.commit("org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x02" + b"0" * 64})
    response = service.client.post("/v1/merges", json=swap(task="hf://org/pickled"))
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "hub_not_safetensors"
    assert "pytorch_model.bin" in error["message"] and "safetensors" in error["message"]


def test_hub_down_at_submit_is_503_and_rate_limits_are_503(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    hub.rate_limit(1)
    limited = service.client.post("/v1/merges", json=swap())
    assert limited.status_code == 503 and limited.json()["error"]["code"] == "hub_rate_limited"
    assert "Retry-After" in limited.headers
    hub.stop()
    try:
        down = service.client.post("/v1/merges", json=swap())
    finally:
        hub.start()
    assert down.status_code == 503 and down.json()["error"]["code"] == "hub_unavailable"
    assert "Retry-After" in down.headers
    assert service.client.post("/v1/merges", json=swap()).status_code == 202


# --- errors while the job runs ------------------------------------------------------------


def held_job(tmp_path: Path, examples: Path, body: dict[str, Any]) -> Any:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    return running_service(
        tmp_path,
        url,
        examples,
        job_executor=HeldExecutor(),
        hub_credentials={"default": {"team-a": TOKEN}},
    )


def test_rate_limits_during_the_job_are_retried(
    tmp_path: Path, examples: Path, hub: Any, experts: dict[str, str]
) -> None:
    with held_job(tmp_path, examples, swap()) as service:
        job = service.submit(swap())
        hub.rate_limit(3)
        run_job(job["id"], db=service.db, settings=service.settings)
        done = service.client.get(f"/v1/merges/{job['id']}").json()
    assert done["status"] == "succeeded", done["error"]
    assert sum(r.status == 429 for r in hub.requests) == 3


@pytest.mark.parametrize("status", [500, 502, 503])
def test_hub_outages_during_the_job_are_retried(
    tmp_path: Path, examples: Path, hub: Any, experts: dict[str, str], status: int
) -> None:
    with held_job(tmp_path, examples, swap()) as service:
        job = service.submit(swap())
        hub.clear_requests()
        hub.fail_requests(2, status=status)  # the job's first two Hub requests fail
        run_job(job["id"], db=service.db, settings=service.settings)
        done = service.client.get(f"/v1/merges/{job['id']}").json()
    assert done["status"] == "succeeded", done["error"]
    assert [r.status for r in hub.requests if r.fault == "outage"] == [status, status]


def test_a_full_disk_under_the_hub_cache_fails_the_job_as_disk_full_once(
    tmp_path: Path, examples: Path, hub: Any, experts: dict[str, str], small_filesystem: Any
) -> None:
    tiny = small_filesystem(128 * 1024)  # smaller than one shard of the experts
    with held_job(tmp_path, examples, swap()) as service:
        job = service.submit(swap())
        cache = service.settings.cache_dir / "hub"
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.symlink_to(tiny, target_is_directory=True)
        run_job(job["id"], db=service.db, settings=service.settings)
        done = service.client.get(f"/v1/merges/{job['id']}").json()
    assert done["status"] == "failed"
    assert done["error"]["code"] == "disk_full", done["error"]
    assert done["attempts"] == 1, "a full disk is not retried"


def test_publishing_is_private_by_default_and_goes_to_the_named_branch(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    first = service.wait(service.submit(swap(output=to_hub("team-a/fresh")))["id"])
    assert first["status"] == "succeeded", first["error"]
    assert hub.is_private("team-a/fresh")

    body = swap(output={"name": "on-branch",
                        "hub": {"repo": "team-a/branched", "credential": "team-a",
                                "branch": "exp-1", "private": False}})  # fmt: skip
    done = service.wait(service.submit(body)["id"])
    assert done["status"] == "succeeded", done["error"]
    published = done["result"]["published"]
    assert published["branch"] == "exp-1"
    assert hub.branches("team-a/branched")["exp-1"] == published["commit"]
    assert "config.json" in hub.files("team-a/branched", "exp-1")
    assert "config.json" not in hub.files("team-a/branched", "main"), "main is left alone"
    assert not hub.is_private("team-a/branched")


def test_a_file_missing_from_the_commit_fails_the_job(
    tmp_path: Path, examples: Path, hub: Any, sharded_family: Path
) -> None:
    """The index names a shard the repository does not hold."""
    files = {p.name: p.read_bytes() for p in (sharded_family / "math").iterdir()}
    shard = sorted(n for n in files if n.endswith(".safetensors"))[0]
    del files[shard]
    hub.create_repo("org/broken")
    hub.commit("org/broken", files)
    upload(hub, "org/swh", sharded_family / "swh")
    with held_job(tmp_path, examples, swap()) as service:
        job = service.submit(swap(task="hf://org/broken"))
        run_job(job["id"], db=service.db, settings=service.settings)
        done = service.client.get(f"/v1/merges/{job['id']}").json()
    assert done["status"] == "failed"
    assert done["error"]["code"] == "hub_file_missing"
    assert shard in done["error"]["message"]


def test_the_hub_going_away_fails_the_job_clearly(
    tmp_path: Path, examples: Path, hub: Any, experts: dict[str, str]
) -> None:
    with held_job(tmp_path, examples, swap()) as service:
        job = service.submit(swap(output=to_hub()))
        hub.stop()
        try:
            run_job(job["id"], db=service.db, settings=service.settings)
        finally:
            hub.start()
        done = service.client.get(f"/v1/merges/{job['id']}").json()
    assert done["status"] == "failed"
    assert done["error"]["code"] == "hub_unavailable"
    assert not any("team-a/merged" in r.path for r in hub.requests)  # never touched


# --- publishing ---------------------------------------------------------------------------


def test_a_job_failing_before_publishing_leaves_the_destination_untouched(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    body = swap(output=to_hub())
    body["params"]["bottom"] = LAYERS  # more layers than the model has: fails at plan time
    done = service.wait(service.submit(body)["id"])
    assert done["status"] == "failed"
    assert not any("team-a/merged" in r.path for r in hub.requests)


def test_a_lost_commit_response_does_not_make_a_second_commit(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    hub.fail_commits(1, mode="lost_response")  # committed, but the client hears nothing
    done = service.wait(service.submit(swap(output=to_hub()))["id"])
    assert done["status"] == "succeeded", done["error"]
    assert len(hub.commits("team-a/merged")) == 2
    assert done["output"]["published"][0]["commit"] == hub.head("team-a/merged")


def test_a_cut_upload_is_resumed_into_one_commit(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    hub.fail_uploads(2, mode="drop")
    done = service.wait(service.submit(swap(output=to_hub()))["id"])
    assert done["status"] == "succeeded", done["error"]
    assert len(hub.commits("team-a/merged")) == 2


def test_a_retried_job_does_not_commit_twice(
    tmp_path: Path, examples: Path, hub: Any, experts: dict[str, str]
) -> None:
    """Attempt 1 published (committed) and died before recording: attempt 2 adopts the local
    output and finds the commit already there."""
    with held_job(tmp_path, examples, swap()) as service:
        job = service.submit(swap(output=to_hub()))
        run_job(job["id"], db=service.db, settings=service.settings)
        first = service.client.get(f"/v1/merges/{job['id']}").json()
        assert first["status"] == "succeeded", first["error"]
        with service.db.session() as session:  # as if the success had never been recorded
            row = session.get(Job, job["id"])
            assert row is not None
            row.status, row.output_artifact_id, row.result = "queued", None, None
            session.execute(text("DELETE FROM lineage_edges"))
            for event in session.scalars(select(JobEvent).where(JobEvent.type == "succeeded")):
                session.delete(event)
            for artifact in session.scalars(select(Artifact)):
                session.delete(artifact)
        run_job(job["id"], db=service.db, settings=service.settings)
        second = service.client.get(f"/v1/merges/{job['id']}").json()
    assert second["status"] == "succeeded" and second["attempts"] == 2
    assert len(hub.commits("team-a/merged")) == 2
    assert second["output"]["published"][0]["commit"] == first["output"]["published"][0]["commit"]


# --- the command line takes the same sources and destinations ------------------------------


def cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "layerswap"), *args],
        cwd=tmp_path,
        env={**os.environ, "LAYERSWAP_CACHE_DIR": str(tmp_path / "cache"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_merges_from_and_publishes_to_the_hub(
    tmp_path: Path, hub: Any, experts: dict[str, str], sharded_family: Path
) -> None:
    recipe = swap(credential="team-a", output=to_hub("team-a/from-cli"))
    recipe["output"].pop("name")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    credentials = json.dumps({"default": {"team-a": TOKEN}})

    planned = cli(tmp_path, "merge", "recipe.yaml", "--out", "out", "--dry-run",
                  LAYERSWAP_HUB_CREDENTIALS=credentials)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert "language" in planned.stdout and not (tmp_path / "out").exists()
    shards = [p.name for p in (sharded_family / "math").glob("*.safetensors")]
    size = {n: (sharded_family / "math" / n).stat().st_size for n in shards}
    assert all(hub.bytes_served("org/math", n) < size[n] / 4 for n in shards), "headers only"

    merged = cli(tmp_path, "merge", "recipe.yaml", "--out", "out", "-q",
                 LAYERSWAP_HUB_CREDENTIALS=credentials)  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    assert f"org/math@main -> commit {experts['math']}" in merged.stderr
    assert "published to" in merged.stdout
    assert TOKEN not in merged.stdout + merged.stderr
    remote = hub.files("team-a/from-cli")
    local = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local

    again = cli(tmp_path, "merge", "recipe.yaml", "--out", "out", "-q", "--overwrite",
                LAYERSWAP_HUB_CREDENTIALS=credentials)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert len(hub.commits("team-a/from-cli")) == 2, "the same output is not committed twice"


def test_cli_hub_errors_are_one_line(tmp_path: Path, hub: Any, experts: dict[str, str]) -> None:
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(swap(task="hf://org/missing")))
    result = cli(tmp_path, "merge", "recipe.yaml", "--out", "out")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "layerswap: error [hub_repo_not_found]: hf://org/missing@main: repository not found "
        "(or private, and the credential cannot see it)"
    ]


def test_concurrent_fetches_download_each_file_once(
    tmp_path: Path, hub: Any, experts: dict[str, str], sharded_family: Path
) -> None:
    import threading

    from core.hub.fetch import fetch_inputs
    from core.hub.pin import pin_recipe
    from engine.recipe import parse_recipe

    recipe, _ = pin_recipe(parse_recipe(swap()), None)
    results: list[Any] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def fetch() -> None:
        try:
            barrier.wait(timeout=30)
            results.append(
                fetch_inputs(recipe, cache_dir=tmp_path / "cache", token=None, local=Path)
            )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for repo, expert in (("org/math", "math"), ("org/swh", "swh")):
        for shard in (sharded_family / expert).glob("*.safetensors"):
            header, tensors = shard_layout(shard)
            read = sum(p.stop - p.start for t, p in tensors.items() if read_by_swap(expert, t))
            size = shard.stat().st_size
            # the header once, then the whole file or the ranges read, once
            once = header + (size if read == size - header else read)
            assert hub.bytes_served(repo, shard.name) == once, (repo, shard.name)
    for fetched in results:
        assert_views_hold_what_the_swap_reads(fetched, sharded_family)
        fetched.close()


def test_a_later_job_fetches_only_the_ranges_still_missing(
    tmp_path: Path, hub: Any, experts: dict[str, str], sharded_family: Path
) -> None:
    """A swap with bottom 1, then one with bottom 2 over the same cache: the second fetches
    the language expert's layer 1 and nothing else (the task expert's layers it reads are a
    subset of the first's)."""
    from core.hub.fetch import fetch_inputs
    from core.hub.pin import pin_recipe
    from engine.recipe import parse_recipe

    def fetch(bottom: int) -> None:
        spec = swap()
        spec["params"]["bottom"] = bottom
        recipe, _ = pin_recipe(parse_recipe(spec), None)
        fetch_inputs(recipe, cache_dir=tmp_path / "cache", token=None, local=Path).close()

    fetch(1)
    before = served(hub, sharded_family)
    fetch(2)
    after = served(hub, sharded_family)
    for repo, expert in (("org/math", "math"), ("org/swh", "swh")):
        for shard in sorted((sharded_family / expert).glob("*.safetensors")):
            _, tensors = shard_layout(shard)
            first = {t for t in tensors if read_by_swap(expert, t, bottom=1)}
            second = {t for t in tensors if read_by_swap(expert, t, bottom=2)}
            whole = sum(p.stop - p.start for p in tensors.values())
            if sum(tensors[t].stop - tensors[t].start for t in second) == whole:
                new = 0 if first == second else shard.stat().st_size  # a whole download
            else:
                new = sum(tensors[t].stop - tensors[t].start for t in second - first)
            key = f"{repo}/{shard.name}"
            assert after[key] - before[key] == new, (key, sorted(second - first))
    assert sum(after.values()) > sum(before.values())  # layer 1 of swh was fetched


def test_a_cut_range_is_resumed_from_where_it_stopped(
    tmp_path: Path, hub: Any, experts: dict[str, str], sharded_family: Path
) -> None:
    from core.hub.fetch import fetch_inputs
    from core.hub.pin import pin_recipe
    from engine.recipe import parse_recipe

    recipe, _ = pin_recipe(parse_recipe(swap()), None)
    cache = tmp_path / "cache"
    fetch_inputs(recipe, cache_dir=cache, token=None, local=Path, headers_only=True).close()
    hub.clear_requests()
    hub.fail_downloads(1, after_bytes=64)  # the next download, the first range, is cut
    fetched = fetch_inputs(recipe, cache_dir=cache, token=None, local=Path)
    downloads = [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    cut, resumed = downloads[0], downloads[1]
    assert cut.fault == "cut" and cut.range and resumed.range
    (cut_first, cut_last), (first, last) = (
        map(int, r.range.removeprefix("bytes=").split("-")) for r in (cut, resumed)
    )
    assert resumed.path == cut.path and cut_first <= first <= cut_first + 64  # from what arrived
    assert last == cut_last
    assert_views_hold_what_the_swap_reads(fetched, sharded_family)  # the Hub's bytes
    fetched.close()


def test_gated_sources_work_for_a_credential_with_access(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    hub.add_token(TOKEN, user="team-a", read=["team-a/*", "org/gated"], write=["team-a/*"])
    job = service.submit(swap(task="hf://org/gated", credential="team-a"))
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["sources"][0]["sha"] == experts["gated"]


def test_publishing_where_the_credential_may_not_write_fails_clearly(
    service: Service, hub: Any, experts: dict[str, str]
) -> None:
    done = service.wait(service.submit(swap(output=to_hub("org/not-ours")))["id"])
    assert done["status"] == "failed"
    assert done["error"]["code"] == "hub_unauthorized"
    assert "org/not-ours" in done["error"]["message"] and TOKEN not in json.dumps(done)
    assert not [r for r in hub.requests if r.method == "POST" and "commit" in r.path]
    # A failed job leaves no output: the same name can be asked for again.
    assert not (service.settings.artifacts_dir / "default" / "merged").exists()
    again = service.client.post("/v1/merges", json=swap(output=to_hub("team-a/ours")))
    assert again.status_code == 202, again.text


def test_views_left_by_killed_jobs_are_pruned(
    tmp_path: Path, hub: Any, experts: dict[str, str]
) -> None:
    from core.hub.fetch import fetch_inputs
    from core.hub.pin import pin_recipe
    from engine.recipe import parse_recipe

    views = tmp_path / "cache" / "views"
    old, recent = views / "old", views / "recent"
    for view in (old, recent):
        view.mkdir(parents=True)
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    recipe, _ = pin_recipe(parse_recipe(swap()), None)
    fetched = fetch_inputs(
        recipe, cache_dir=tmp_path / "cache", token=None, local=Path, headers_only=True
    )
    assert not old.exists() and recent.exists()
    fetched.close()
    assert recent.exists() and not any(p == fetched.root for p in views.iterdir())


# --- the command line against the Hub ---------------------------------------------------------


def cli_merge(tmp_path: Path, out: str, cache: Path, **env: str) -> subprocess.Popen[str]:
    """`layerswap merge` of swap() in its own process (the suite's HF_ENDPOINT, no token unless
    `env` gives one), its Hub downloads cached under `cache`."""
    recipe = tmp_path / "swap.yaml"
    recipe.write_text(yaml.safe_dump(swap()), encoding="utf-8")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    environment.pop("HF_TOKEN", None)
    environment.update(LAYERSWAP_CACHE_DIR=str(cache), **env)
    layerswap = Path(sys.executable).parent / "layerswap"
    return subprocess.Popen(
        [str(layerswap), "merge", str(recipe), "--out", str(tmp_path / out), "-q", "--no-fsync"],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finished_ok(process: subprocess.Popen[str]) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out + err


def served(hub: Any, family: Path) -> dict[str, int]:
    """Bytes the hub has sent so far of every file of org/math and org/swh."""
    return {
        f"{repo}/{p.name}": hub.bytes_served(repo, p.name)
        for repo, expert in (("org/math", "math"), ("org/swh", "swh"))
        for p in (family / expert).iterdir()
    }


def test_concurrent_processes_download_each_file_once(
    tmp_path: Path, hub: Any, experts: dict[str, str], sharded_family: Path
) -> None:
    """Two merges in two processes at once, sharing one cache, fetch exactly the bytes one
    merge alone fetches: the cache's file locks make one process download, the other wait."""
    before = served(hub, sharded_family)
    finished_ok(cli_merge(tmp_path, "alone", tmp_path / "cache-alone"))
    alone = {k: v - before[k] for k, v in served(hub, sharded_family).items()}
    assert sum(alone.values()) > 0

    before = served(hub, sharded_family)
    pair = [cli_merge(tmp_path, name, tmp_path / "cache-shared") for name in ("one", "two")]
    for process in pair:
        finished_ok(process)
    together = {k: v - before[k] for k, v in served(hub, sharded_family).items()}
    assert together == alone
    for name in ("one", "two"):
        weights = sorted((tmp_path / name).glob("*.safetensors"))
        assert [p.name for p in weights] == sorted(
            p.name for p in (tmp_path / "alone").glob("*.safetensors")
        )
        for path in weights:
            assert path.read_bytes() == (tmp_path / "alone" / path.name).read_bytes()


def test_the_cli_uses_hf_token_when_no_credential_is_named(
    tmp_path: Path, hub: Any, experts: dict[str, str]
) -> None:
    recipe_source = "hf://team-a/private-math"
    body = swap(task=recipe_source)
    (tmp_path / "swap.yaml").write_text(yaml.safe_dump(body), encoding="utf-8")

    def run(**env: str) -> subprocess.CompletedProcess[str]:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
        environment.pop("HF_TOKEN", None)
        environment.update(LAYERSWAP_CACHE_DIR=str(tmp_path / "cache"), **env)
        return subprocess.run(
            [str(Path(sys.executable).parent / "layerswap"), "merge", str(tmp_path / "swap.yaml"),
             "--out", str(tmp_path / "out"), "-q", "--no-fsync"],
            env=environment, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    hub.clear_requests()
    refused = run()  # no token: the private repository is not found, as the Hub says it
    assert refused.returncode == 1, refused.stderr
    assert "team-a/private-math" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "out").exists()
    assert all(r.token is None for r in hub.requests)

    hub.clear_requests()
    merged = run(HF_TOKEN=TOKEN)
    assert merged.returncode == 0, merged.stderr
    private = [r for r in hub.requests if "team-a/private-math" in r.path]
    assert private and all(r.token == TOKEN for r in private)
    assert TOKEN not in merged.stdout + merged.stderr
    assert (tmp_path / "out" / "config.json").is_file()
