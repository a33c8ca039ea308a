"""Symlinks in a checkpoint directory never lead out of the allowed roots, nor into another
tenant's artifacts: such a source is refused at submit naming the file (merges, analyses,
evaluations), and a link swapped in after that check is refused when the job opens the file
(the engine checks the path each opened file really has). Links that stay inside the roots
are followed, and the engine alone (the CLI) follows every link, as before."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.settings import Settings
from core.sources import file_guard, resolve_source
from engine.errors import CheckpointError
from engine.io.checkpoint import Checkpoint
from engine.merge import MergeOptions, merge
from engine.recipe import parse_recipe
from tests.helpers import leftovers
from tests.service.conftest import Service, make_settings, running_service

TENANT = "default"
EVALUATION = {"tasks": ["mgsm_local_direct_sw"], "num_fewshot": 0, "batch_size": 1}


@pytest.fixture
def service(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, database_url, examples) as running:
        yield running


def linked_copy(root: Path, name: str, model: Path, link: str, target: Path) -> Path:
    """root/name: a copy of `model` whose file `link` is a symlink to `target`."""
    copy = root / name
    shutil.copytree(model, copy)
    (copy / link).unlink()
    (copy / link).symlink_to(target)
    return copy


def refusal(response: Any, field: str, file: str) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    error = dict(response.json()["error"])
    assert error["code"] == "source_not_allowed", error
    assert error["details"] == {"field": field, "file": file}
    assert file in error["message"]
    return error


def test_a_shard_linked_outside_the_roots_is_refused_by_name(
    service: Service, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(service.checkpoints / "swh", elsewhere)
    shard = "model.safetensors"
    linked_copy(
        service.checkpoints, "linked", service.checkpoints / "swh", shard, elsewhere / shard
    )

    merge_body = {"method": "soup", "models": ["math", "linked"]}
    refusal(service.client.post("/v1/merges", json=merge_body), "models.1", shard)
    analysis = {"base": "base", "experts": [{"label": "l", "path": "linked"}]}
    refusal(service.client.post("/v1/analyses", json=analysis), "experts.0.path", shard)
    evaluation = {"source": "linked", "evaluation": EVALUATION}
    refusal(service.client.post("/v1/evaluations", json=evaluation), "source", shard)

    # Named as a Hub repository could be, it is still the local directory, refused by name.
    swh = service.checkpoints / "swh"
    linked_copy(service.checkpoints / "team", "linked", swh, shard, elsewhere / shard)
    models = [{"model": "math", "parameters": {"weight": 1}},
              {"model": "team/linked", "parameters": {"weight": 1}}]  # fmt: skip
    config = {"mergekit": {"merge_method": "linear", "models": models}}
    refusal(service.client.post("/v1/merges", json=config), "mergekit.models.1.model", shard)
    assert service.client.get("/v1/merges").json()["items"] == []


def test_a_link_into_another_tenants_artifacts_is_refused_and_inside_the_roots_followed(
    service: Service,
) -> None:
    artifacts = service.settings.artifacts_dir
    theirs, mine = artifacts / "other" / "secret", artifacts / TENANT / "mine"
    for output in (theirs, mine):
        shutil.copytree(service.checkpoints / "swh", output)
    swh, tokenizer = service.checkpoints / "swh", "tokenizer.json"
    linked_copy(service.checkpoints, "stolen", swh, tokenizer, theirs / tokenizer)
    error = refusal(
        service.client.post("/v1/merges", json={"method": "soup", "models": ["stolen", "math"]}),
        "models.0",
        tokenizer,
    )
    assert "other" not in error["message"]  # where it leads is not told

    # Into the roots: another checkpoint's shard, the tenant's own output's tokenizer.
    model = "model.safetensors"
    aliased = linked_copy(service.checkpoints, "aliased", swh, model, swh / model)
    (aliased / tokenizer).unlink()
    (aliased / tokenizer).symlink_to(mine / tokenizer)
    job = service.submit({"method": "soup", "models": ["aliased", "math"]})
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]


@pytest.fixture
def settings(tmp_path: Path, examples: Path) -> Settings:
    """Settings whose source root holds copies of the example checkpoints (no service)."""
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'unused.db'}")
    for name in ("math", "swh"):
        shutil.copytree(examples / name, settings.source_roots[0] / name)
    return settings


def swap_in_link(directory: Path, name: str, target: Path) -> None:
    (directory / name).unlink()
    (directory / name).symlink_to(target)


def test_a_link_swapped_in_after_the_check_is_refused_when_the_job_reads(
    settings: Settings, tmp_path: Path, examples: Path
) -> None:
    root = settings.source_roots[0]
    resolved = {s: resolve_source(s, settings, TENANT) for s in ("math", "swh")}  # passes
    secret = tmp_path / "secret"
    shutil.copytree(examples / "swh", secret)
    swap_in_link(root / "math", "tokenizer_config.json", secret / "tokenizer_config.json")
    recipe = parse_recipe({"method": "soup", "models": ["math", "swh"]})
    guarded = MergeOptions(durable=False, file_guard=file_guard(settings, TENANT))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json") as refused:
        merge(recipe, tmp_path / "out", resolve=resolved.__getitem__, options=guarded)
    assert refused.value.details == {"path": str(root / "math" / "tokenizer_config.json")}
    assert leftovers(tmp_path / "out") == []  # refused before the output was published

    # The engine alone (no guard: the CLI) follows the user's own links, as it always did.
    merged = merge(recipe, tmp_path / "cli", resolve=resolved.__getitem__,
                   options=MergeOptions(durable=False))  # fmt: skip
    copied = (merged.out_dir / "tokenizer_config.json").read_bytes()
    assert copied == (secret / "tokenizer_config.json").read_bytes()


def test_a_shard_swapped_after_its_header_was_read_is_refused_before_its_data(
    settings: Settings, tmp_path: Path, examples: Path
) -> None:
    swh = settings.source_roots[0] / "swh"
    checkpoint = Checkpoint.open(swh, file_guard(settings, TENANT))  # every file inside
    outside = tmp_path / "outside.safetensors"
    shutil.copy(examples / "math" / "model.safetensors", outside)
    swap_in_link(swh, "model.safetensors", outside)
    info = next(iter(checkpoint.tensors.values()))
    try:
        with pytest.raises(CheckpointError, match=r"model\.safetensors"):
            checkpoint.read_into(info, memoryview(bytearray(info.nbytes)))
    finally:
        checkpoint.close()
    with pytest.raises(CheckpointError, match="leads outside the allowed source directories"):
        Checkpoint.open(swh, file_guard(settings, TENANT))


def test_hub_inputs_read_only_the_hub_cache(settings: Settings, tmp_path: Path) -> None:
    """A Hub input's view links into the Hub cache, which no local source may reach."""
    guard = file_guard(settings, TENANT)
    hub = (settings.cache_dir / "hub").resolve()
    view = settings.cache_dir / "hub" / "views" / "job" / "0"
    assert guard(view, hub / "files" / "blob") is None
    assert guard(view, settings.source_roots[0] / "math" / "config.json") is not None
    local = settings.source_roots[0] / "math"
    assert guard(local, local / "config.json") is None
    assert guard(local, hub / "files" / "blob") is not None
    assert guard(local, settings.artifacts_dir.resolve() / "other" / "x" / "config.json")
    assert guard(local, settings.artifacts_dir.resolve() / TENANT / "x" / "config.json") is None
