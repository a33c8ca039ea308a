"""Inputs that claim too much, a full disk, and cancellation in every phase (issue 9).

Every case uses real files (copies of the fixture checkpoints, edited) and real filesystems
(tmpfs mounts of a chosen size for ENOSPC)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import traceback
from pathlib import Path
from typing import Any

import pytest

from engine.errors import (
    CheckpointError,
    DiskFull,
    MergeCanceled,
    OutputError,
    RecipeError,
    is_disk_full,
)
from engine.merge import MergeOptions, merge
from engine.recipe import parse_recipe
from tests.conftest import Family
from tests.helpers import leftovers, stringify
from tests.reference import combine, inverse_weights, load, magnitude


def soup(*models: Path) -> dict[str, Any]:
    return {"method": "soup", "models": list(models)}


def ties(fam: Family) -> dict[str, Any]:
    return {"method": "ties", "base": fam.base, "models": [fam.task, fam.language],
            "params": {"density": 0.5}}  # fmt: skip


def copy_of(source: Path, where: Path) -> Path:
    shutil.copytree(source, where)
    return where


def edit_config(checkpoint: Path, **values: Any) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **values}))


# -- bounded inputs ------------------------------------------------------------------------------


def test_a_huge_layer_count_is_refused_before_anything_is_allocated(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    bad = copy_of(llama.task, tmp_path / "task")
    edit_config(bad, num_hidden_layers=10_000_000_000)
    with pytest.raises(CheckpointError) as info:
        run_merge(soup(bad, llama.language), tmp_path / "out")
    assert "num_hidden_layers is 10000000000; at most 4096" in info.value.message
    assert info.value.details["path"] == str(bad / "config.json")


@pytest.mark.parametrize("where", ["config", "header"])
def test_deeply_nested_json_is_a_checkpoint_error(
    where: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    bad = copy_of(llama.task, tmp_path / "task")
    nested = b"[" * 200_000 + b"]" * 200_000
    if where == "config":
        (bad / "config.json").write_bytes(b'{"a": ' + nested + b"}")
    else:
        body = b'{"__metadata__": ' + nested + b"}"
        body += b" " * (-len(body) % 8)
        (bad / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CheckpointError) as info:
        run_merge(soup(bad, llama.language), tmp_path / "out")
    assert "nested too deeply" in info.value.message


def test_a_tensor_of_too_many_dimensions_is_refused(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    bad = copy_of(llama.task, tmp_path / "task")
    entries = {"x": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}}
    body = json.dumps(entries).encode()
    body += b" " * (-len(body) % 8)
    (bad / "extra.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 4)
    with pytest.raises(CheckpointError) as info:
        run_merge(soup(bad, llama.language), tmp_path / "out")
    assert "9 dimensions; at most 8" in info.value.message


def test_an_oversized_side_file_is_refused_and_nothing_is_left(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    bad = copy_of(llama.language, tmp_path / "language")
    with open(bad / "tokenizer.json", "r+b") as f:  # sparse: 1 GiB + 1 byte, no disk used
        f.truncate(1024**3 + 1)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:
        run_merge(soup(bad, llama.task), out)  # the first model gives the tokenizer
    assert "tokenizer.json" in info.value.details["path"]
    assert "at most 1073741824" in info.value.message
    assert leftovers(out) == []


def test_too_many_output_shards_is_a_recipe_error(run_merge: Any, tmp_path: Path) -> None:
    from worker.examples import make_checkpoint

    size = {"layers": 256, "hidden": 32, "intermediate": 32, "heads": 2, "kv_heads": 1}
    a = make_checkpoint(tmp_path / "a", seed=0, **size)  # type: ignore[arg-type]
    b = make_checkpoint(tmp_path / "b", seed=1, **size)  # type: ignore[arg-type]
    recipe = {**soup(a, b), "output": {"shard_size": "2KB"}}  # ~6 shards per layer
    with pytest.raises(RecipeError) as info:
        run_merge(recipe, tmp_path / "out")
    assert info.value.details["field"] == "output.shard_size"
    assert "at most 512" in info.value.message
    assert leftovers(tmp_path / "out") == []


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_writer_that_fails_to_start_closes_every_descriptor(tmp_path: Path) -> None:
    from engine.io.writer import OutputWriter

    (tmp_path / "model-00005-of-00008.safetensors").mkdir()  # the fifth file cannot be made
    files = [(f"model-{i:05d}-of-00008.safetensors", b"header--", 8) for i in range(1, 9)]
    before = open_descriptors()
    with pytest.raises(OutputError) as info:
        OutputWriter(tmp_path, files)
    assert "model-00005-of-00008.safetensors" in info.value.message
    assert open_descriptors() == before


# -- a full disk ---------------------------------------------------------------------------------


def fill(path: Path) -> int:
    """Write zeros until the filesystem refuses (ENOSPC); the bytes it took."""
    with open(path, "wb", buffering=0) as f, pytest.raises(OSError) as full:
        while True:
            f.write(b"\0" * 4096)
    assert is_disk_full(full.value)
    return path.stat().st_size


def test_too_little_free_space_is_refused_before_writing(
    llama: Family, run_merge: Any, small_filesystem: Any
) -> None:
    tiny = small_filesystem(64 * 1024)
    out = tiny / "out"
    with pytest.raises(DiskFull) as info:
        run_merge(soup(llama.task, llama.language), out)
    details = info.value.details
    assert info.value.code == "disk_full" and details["needed_bytes"] > details["free_bytes"]
    assert os.listdir(tiny) == []


def test_the_disk_filling_up_mid_merge_is_disk_full_and_leaves_nothing(
    llama: Family, run_merge: Any, small_filesystem: Any, tmp_path: Path
) -> None:
    roomy = small_filesystem(8 * 1024 * 1024)
    out = roomy / "out"
    filled: list[int] = []

    def fill_the_disk(progress: Any) -> None:
        # At the first report the output files exist and hold their headers: take what is left.
        if not filled:
            filled.append(fill(roomy / "ballast"))

    with pytest.raises(DiskFull) as info:
        merge(parse_recipe(stringify(ties(llama))), out, resolve=Path,
              options=MergeOptions(durable=False), on_progress=fill_the_disk)  # fmt: skip
    assert filled, "the disk was filled during the merge"
    assert info.value.code == "disk_full"
    assert sorted(os.listdir(roomy)) == ["ballast"]


def test_the_digest_cache_skips_a_write_that_does_not_fit(
    small_filesystem: Any, tmp_path: Path
) -> None:
    import hashlib

    from engine.io.digests import file_sha256

    cache = small_filesystem(64 * 1024)
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(10_000))
    fill(cache / "ballast")

    assert file_sha256(data, cache) == hashlib.sha256(data.read_bytes()).hexdigest()
    assert sorted(os.listdir(cache)) == ["ballast"]  # no entry, no temporary file


# -- the sha256 cache ------------------------------------------------------------------------


def test_the_digest_cache_notices_a_rewrite_that_keeps_size_and_mtime(tmp_path: Path) -> None:
    import hashlib

    from engine.io.digests import file_sha256

    cache = tmp_path / "cache"
    data = tmp_path / "data.bin"
    data.write_bytes(b"a" * 4096)
    stat = data.stat()
    assert file_sha256(data, cache) == hashlib.sha256(b"a" * 4096).hexdigest()
    with open(data, "r+b") as f:  # same inode, same size
        f.write(b"b" * 4096)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime put back, as cp -p does
    assert data.stat().st_mtime_ns == stat.st_mtime_ns
    assert file_sha256(data, cache) == hashlib.sha256(b"b" * 4096).hexdigest()


# -- cancellation in every phase -----------------------------------------------------------


def test_cancel_during_planning_stops_before_anything_exists(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    recipe = {
        "method": "layer_swap", "base": llama.base,
        "experts": {"task": [llama.task], "language": [llama.language]},
        "params": {"bottom": 1, "top": 1, "bottom_transition": 1,
                   "transition_weights": "magnitude"},
    }  # fmt: skip
    out = tmp_path / "out"
    with pytest.raises(MergeCanceled) as info:
        run_merge(recipe, out, should_cancel=lambda: True)
    assert "while planning" in info.value.message
    assert leftovers(out) == []


def test_cancel_during_ties_top_k_stops_inside_the_selection(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    selection = {"top_k", "_select"}  # the torch kernels' (cuda), the compiled ones' (cpu)
    calls: list[str] = []

    def cancel_inside_selection() -> bool:
        stack = {frame.name for frame in traceback.extract_stack()}
        calls.append("selection" if stack & selection else "other")
        return calls[-1] == "selection"

    out = tmp_path / "out"
    with pytest.raises(MergeCanceled) as info:
        run_merge(ties(llama), out, should_cancel=cancel_inside_selection)
    assert calls.count("selection") == 1, "canceled at the first check inside a top-k pass"
    frames = {frame.name for frame in traceback.extract_tb(info.value.__traceback__)}
    assert frames & selection
    assert leftovers(out) == []


def test_hashing_stops_when_asked(tmp_path: Path) -> None:
    from engine.io.digests import BLOCK, file_sha256

    data = tmp_path / "big.bin"
    with open(data, "wb") as f:
        f.truncate(BLOCK * 4)
    asked: list[int] = []

    def stop_after_two_blocks() -> bool:
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(MergeCanceled):
        file_sha256(data, tmp_path / "cache", should_stop=stop_after_two_blocks)
    assert len(asked) == 3
    assert not (tmp_path / "cache").exists() or os.listdir(tmp_path / "cache") == []


# -- magnitude transition weights with several experts per role ----------------------------


@pytest.mark.parametrize("expert_soup", ["uniform", "magnitude"])
def test_magnitude_transitions_with_several_experts_per_role(
    expert_soup: str, llama: Family, run_merge: Any
) -> None:
    tasks, languages = [llama.task, llama.task2], [llama.language, llama.language2, llama.language3]
    params = {"bottom": 1, "top": 1, "bottom_transition": 1, "top_transition": 1,
              "transition_weights": "magnitude", "expert_soup": expert_soup,
              "non_layer": "task"}  # fmt: skip
    experts = {"task": tasks, "language": languages}
    recipe = {"method": "layer_swap", "base": llama.base, "experts": experts, "params": params}
    result = run_merge(recipe)

    base = load(llama.base)
    task_models, language_models = [load(p) for p in tasks], [load(p) for p in languages]
    m_tasks = [magnitude(m, base) for m in task_models]
    m_languages = [magnitude(m, base) for m in language_models]
    if expert_soup == "uniform":
        task_soup, language_soup = [1 / 2] * 2, [1 / 3] * 3
    else:
        task_soup, language_soup = inverse_weights(m_tasks), inverse_weights(m_languages)
    # A role's magnitude is the soup-weighted mean of its experts' magnitudes (docs/concepts).
    m_task = sum(w * m for w, m in zip(task_soup, m_tasks, strict=True))
    m_language = sum(w * m for w, m in zip(language_soup, m_languages, strict=True))
    w_task, w_language = inverse_weights([m_task, m_language])
    resolved = result.manifest["resolved_weights"]["transition"]
    assert resolved["task"] == pytest.approx(w_task, rel=1e-5)
    assert resolved["language"] == pytest.approx(w_language, rel=1e-5)

    out = load(result.out_dir)
    name = "model.layers.1.mlp.down_proj.weight"  # layer 1: the bottom transition
    t_soup = combine(task_soup, [m[name] for m in task_models])
    l_soup = combine(language_soup, [m[name] for m in language_models])
    expected = (w_task * t_soup + w_language * l_soup).to(out[name].dtype)
    diff = (out[name].float() - expected.float()).abs().max()
    assert diff <= expected.float().abs().max() * 2**-7, name  # within bf16 rounding
