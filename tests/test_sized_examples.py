"""`layerswap examples --size`: checkpoints of about the size asked for, marked as random weights,
that transformers loads and a recipe merges; sharded past the shard size; a bad size is a clear
error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.evaluation.random_weights import has_random_weights
from tests.engine.test_output import assert_forward_pass
from tests.reference import load
from tests.test_cli import layerswap

SIZE = 20 * 10**6


def weight_bytes(checkpoint: Path) -> int:
    return sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))


def test_examples_of_a_size_load_and_merge(tmp_path: Path) -> None:
    examples = tmp_path / "examples"
    made = layerswap("examples", examples, "--size", "20MB", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    for name in ("base", "math", "swh"):
        assert 0.75 * SIZE <= weight_bytes(examples / name) <= 1.25 * SIZE, name
        assert has_random_weights(examples / name)
        assert f"{name}: 100%" in made.stderr  # its progress line, finished
    config = json.loads((examples / "base" / "config.json").read_text())
    assert config["num_hidden_layers"] > 6 and config["hidden_size"] > 64  # scaled up
    assert_forward_pass(examples / "math")
    out = tmp_path / "merged"
    merged = layerswap("merge", examples / "layer_swap.yaml", "--out", out, "-q", "--no-fsync",
                       cwd=examples)  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    assert_forward_pass(out)
    assert has_random_weights(out)  # the mark travels with the config
    ours, math, swh = load(out), load(examples / "math"), load(examples / "swh")
    last = config["num_hidden_layers"] - 1
    for layer, expert in ((0, swh), (1, math), (last - 1, math), (last, swh)):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        assert torch.equal(ours[name], expert[name]), name
    assert not torch.equal(math["model.layers.1.mlp.down_proj.weight"],
                           swh["model.layers.1.mlp.down_proj.weight"])  # fmt: skip


def test_sharded_past_the_shard_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import sized_examples

    monkeypatch.setattr(sized_examples, "SHARD_BYTES", 4 * 10**6)
    paths = sized_examples.make_sized_examples(tmp_path, SIZE)
    index = json.loads((paths["swh"] / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) == len(list(paths["swh"].glob("*.safetensors"))) > 1
    tensors = load(paths["swh"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    assert_forward_pass(paths["swh"])
    monkeypatch.setattr(sized_examples, "SHARD_BYTES", 2 * 10**9)
    again = sized_examples.make_sized_examples(tmp_path, SIZE)  # one file now: no shard left over
    assert sorted(p.name for p in again["swh"].glob("model*")) == ["model.safetensors"]


def test_a_bad_size_is_a_clear_error(tmp_path: Path) -> None:
    for value, says in (("lots", "not a size"), ("1KB", "at least 2MB")):
        proc = layerswap("examples", tmp_path / "out", "--size", value, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert "Invalid value for '--size'" in proc.stderr and says in proc.stderr, proc.stderr
        assert "give tiny, or a size such as 500MB" in proc.stderr
        assert not (tmp_path / "out").exists()
