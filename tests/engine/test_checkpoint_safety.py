"""Unsafe, malformed and mismatched inputs: a documented error naming the file, nothing written."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError, IncompatibleCheckpointsError
from tests.conftest import Family, Sharded
from tests.helpers import leftovers

MB = 1024 * 1024


def craft(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors-like file: u64 length, header bytes (JSON unless bytes), data."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def f32(shape: Any, offsets: Any, dtype: Any = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


MALFORMED: dict[str, tuple[bytes, str]] = {
    "shorter-than-prefix": (b"\x05\x00\x00", "too short"),
    "header-longer-than-file": (
        craft({"w": f32([2], [0, 8])}, b"\0" * 8, length=10_000),
        "truncated",
    ),
    "header-over-100MB": (craft(b"{}", length=200 * MB), "exceeds"),
    "header-length-u64-max": (craft(b"{}", length=2**64 - 1), "exceeds"),
    "invalid-json": (craft(b'{"w": {"dtype": "F32",'), "not valid JSON"),
    "not-utf8": (craft(b'{"\xff\xfe": 1}'), "not valid JSON"),
    "header-not-object": (craft([1, 2, 3]), "not a JSON object"),
    "entry-not-object": (craft({"w": [0, 8]}), "not an object"),
    "metadata-not-strings": (
        craft({"__metadata__": {"format": 1}, "w": f32([2], [0, 8])}, b"\0" * 8),
        "__metadata__",
    ),
    "unknown-dtype": (craft({"w": f32([2], [0, 8], "F17")}, b"\0" * 8), "unknown dtype"),
    "missing-dtype": (
        craft({"w": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "unknown dtype",
    ),
    "shape-offsets-mismatch": (craft({"w": f32([4], [0, 8])}, b"\0" * 8), "needs 16"),
    "huge-shape": (craft({"w": f32([2**40, 2**40], [0, 8])}, b"\0" * 8), "data_offsets"),
    "out-of-bounds": (craft({"w": f32([4], [0, 16])}, b"\0" * 8), "truncated"),
    "far-out-of-bounds": (craft({"w": f32([2], [2**50, 2**50 + 8])}, b"\0" * 8), "truncated"),
    "overlap": (craft({"a": f32([4], [0, 16]), "b": f32([4], [8, 24])}, b"\0" * 24), "overlaps"),
    "negative-shape": (craft({"w": f32([-2], [0, 8])}, b"\0" * 8), "shape"),
    "float-shape": (craft({"w": f32([2.5], [0, 10])}, b"\0" * 10), "shape"),
    "bool-shape": (craft({"w": f32([True], [0, 4])}, b"\0" * 4), "shape"),
    "shape-not-list": (craft({"w": f32("2", [0, 8])}, b"\0" * 8), "shape"),
    "negative-offset": (craft({"w": f32([2], [-8, 0])}, b"\0" * 8), "data_offsets"),
    "reversed-offsets": (craft({"w": f32([0], [8, 0])}, b"\0" * 8), "data_offsets"),
    "offsets-strings": (craft({"w": f32([2], ["0", "8"])}, b"\0" * 8), "data_offsets"),
    "three-offsets": (craft({"w": f32([2], [0, 8, 16])}, b"\0" * 16), "data_offsets"),
}


def broken_copy(good: Path, where: Path) -> Path:
    """A copy of a good checkpoint directory (configs, tokenizer, weights) to damage."""
    shutil.copytree(good, where)
    return where


def assert_nothing_written(out: Path) -> None:
    assert leftovers(out) == [], f"left behind: {leftovers(out)}"


def expect_checkpoint_error(run_merge: Any, recipe: dict[str, Any], out: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        run_merge(recipe, out)
    error = info.value
    assert error.code == "invalid_checkpoint"
    assert error.details["path"] in error.message
    assert "\n" not in error.message
    assert_nothing_written(out)
    return error


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_safetensors(case: str, llama: Family, run_merge: Any, tmp_path: Path) -> None:
    content, expected = MALFORMED[case]
    bad = broken_copy(llama.language, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(content)
    out = tmp_path / "out"
    error = expect_checkpoint_error(run_merge, {"method": "soup", "models": [llama.task, bad]}, out)
    assert error.details["path"] == str(bad / "model.safetensors")
    assert expected in error.message


def test_truncated_real_file(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    bad = broken_copy(llama.language, tmp_path / "bad")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    out = tmp_path / "out"
    error = expect_checkpoint_error(run_merge, {"method": "soup", "models": [llama.task, bad]}, out)
    assert error.details["path"] == str(weights)
    assert "truncated" in error.message


def test_pickle_weights_refused_with_advice(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    """A .bin is never unpickled: this one would create a marker file if it were."""
    marker = tmp_path / "pickle-was-executed"

    class Payload:
        def __reduce__(self) -> Any:
            return (Path.touch, (marker,))

    bad = tmp_path / "pickled"
    bad.mkdir()
    shutil.copy(llama.language / "config.json", bad / "config.json")
    (bad / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Payload()}))
    out = tmp_path / "out"
    error = expect_checkpoint_error(run_merge, {"method": "soup", "models": [llama.task, bad]}, out)
    assert "pytorch_model.bin" in error.message
    assert "safe_serialization=True" in error.message  # how to convert
    assert error.details["path"] == str(bad)
    assert not marker.exists()


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_other_pickle_suffixes_refused(
    suffix: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    bad = tmp_path / "pickled"
    bad.mkdir()
    shutil.copy(llama.language / "config.json", bad / "config.json")
    torch.save({"w": torch.zeros(2)}, bad / f"model{suffix}")
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [llama.task, bad]}, tmp_path / "out"
    )
    assert f"model{suffix}" in error.message


def test_missing_config(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    bad = broken_copy(llama.language, tmp_path / "bad")
    (bad / "config.json").unlink()
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [llama.task, bad]}, tmp_path / "out"
    )
    assert error.details["path"] == str(bad / "config.json")
    assert "missing" in error.message


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"model_type": "llama", "num_hidden_layers": 4}', "4 layers"),
    ],
)
def test_bad_config(
    content: str, expected: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    bad = broken_copy(llama.language, tmp_path / "bad")
    (bad / "config.json").write_text(content)
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [llama.task, bad]}, tmp_path / "out"
    )
    assert str(bad) in error.message
    assert expected in error.message


def test_a_config_without_a_layer_count_stops_only_a_layer_swap(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """Only methods that treat layers differently need a layer count."""
    copies = [
        broken_copy(src, tmp_path / n) for src, n in ((llama.task, "t"), (llama.language, "l"))
    ]
    for copy in copies:
        config = json.loads((copy / "config.json").read_text())
        del config["num_hidden_layers"]
        (copy / "config.json").write_text(json.dumps(config))
    experts = {"task": [copies[0]], "language": [copies[1]]}
    error = expect_checkpoint_error(
        run_merge, {"method": "layer_swap", "experts": experts}, tmp_path / "out"
    )
    assert "model_type 'llama': config.json has no layer count (looked for num_hidden_layers)" in (
        error.message
    )
    result = run_merge({"method": "soup", "models": copies})
    assert result.manifest["layer_stack"]["rule"] == "none"


def test_missing_directory_and_no_weights(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [llama.task, missing]}, tmp_path / "out"
    )
    assert str(missing) in error.message
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(llama.language / "config.json", empty / "config.json")
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [llama.task, empty]}, tmp_path / "out"
    )
    assert "no *.safetensors" in error.message


def test_missing_shard(llama: Family, sharded: Sharded, run_merge: Any, tmp_path: Path) -> None:
    bad = broken_copy(sharded.task, tmp_path / "bad")
    shards = sorted(bad.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [bad, llama.language]}, tmp_path / "out"
    )
    assert error.details["path"] == str(shards[1])
    assert shards[1].name in error.message


def test_index_lists_tensor_missing_from_shards(
    llama: Family, sharded: Sharded, run_merge: Any, tmp_path: Path
) -> None:
    bad = broken_copy(sharded.task, tmp_path / "bad")
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.ghost.weight"] = first_shard
    index_path.write_text(json.dumps(index))
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [bad, llama.language]}, tmp_path / "out"
    )
    assert "model.layers.0.ghost.weight" in error.message
    assert error.details["path"] == str(index_path)


def test_index_points_outside(
    llama: Family, sharded: Sharded, run_merge: Any, tmp_path: Path
) -> None:
    bad = broken_copy(sharded.task, tmp_path / "bad")
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../etc/passwd.safetensors"
    index_path.write_text(json.dumps(index))
    error = expect_checkpoint_error(
        run_merge, {"method": "soup", "models": [bad, llama.language]}, tmp_path / "out"
    )
    assert error.details["path"] == str(index_path)


# -- incompatible inputs ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_models(llama: Family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("odd")
    four_layers = make_checkpoint(root / "four-layers", layers=4, seed=0)
    narrow = make_checkpoint(root / "narrow", layers=6, hidden=32, intermediate=64, seed=0)
    no_tensor = broken_copy(llama.language, root / "missing-tensor")
    tensors = load_file(str(no_tensor / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, str(no_tensor / "model.safetensors"), metadata={"format": "pt"})
    return {"four_layers": four_layers, "narrow": narrow, "missing_tensor": no_tensor}


def expect_incompatible(
    run_merge: Any, recipe: dict[str, Any], out: Path
) -> IncompatibleCheckpointsError:
    with pytest.raises(IncompatibleCheckpointsError) as info:
        run_merge(recipe, out)
    error = info.value
    assert error.code == "incompatible_checkpoints"
    assert error.details["count"] >= len(error.details["mismatches"]) > 0
    assert_nothing_written(out)
    return error


def test_different_layer_count(
    llama: Family, odd_models: dict[str, Path], run_merge: Any, tmp_path: Path
) -> None:
    error = expect_incompatible(
        run_merge,
        {"method": "soup", "models": [llama.task, odd_models["four_layers"]]},
        tmp_path / "out",
    )
    mismatches = error.details["mismatches"]
    assert any(m.startswith("config num_hidden_layers") for m in mismatches)
    assert "model.layers.5.mlp.up_proj.weight: in models[0], missing from models[1]" in mismatches
    assert "num_hidden_layers" in error.message


def test_different_hidden_size(
    llama: Family, odd_models: dict[str, Path], run_merge: Any, tmp_path: Path
) -> None:
    error = expect_incompatible(
        run_merge,
        {
            "method": "layer_swap",
            "experts": {"task": [llama.task], "language": [odd_models["narrow"]]},
            "params": {"bottom": 1, "top": 1},
        },
        tmp_path / "out",
    )
    mismatches = error.details["mismatches"]
    assert any(m.startswith("config hidden_size") for m in mismatches)
    assert any(m.startswith("model.embed_tokens.weight: shape [256, 64]") for m in mismatches)
    assert any(m.startswith("model.layers.0.self_attn.q_proj.weight: shape") for m in mismatches)


def test_missing_tensor(
    llama: Family, odd_models: dict[str, Path], run_merge: Any, tmp_path: Path
) -> None:
    error = expect_incompatible(
        run_merge,
        {
            "method": "ties",
            "base": llama.base,
            "models": [llama.task, odd_models["missing_tensor"]],
        },
        tmp_path / "out",
    )
    mismatches = error.details["mismatches"]
    assert "model.layers.3.mlp.up_proj.weight: in models[0], missing from models[1]" in mismatches
    assert "model.norm.weight: in models[0], missing from models[1]" in mismatches
    assert error.details["count"] == 2


def test_different_dtype_and_architecture(
    llama: Family, llama32: Family, qwen2: Family, run_merge: Any, tmp_path: Path
) -> None:
    error = expect_incompatible(
        run_merge, {"method": "soup", "models": [llama.task, llama32.task]}, tmp_path / "out"
    )
    assert (
        "lm_head.weight: dtype BF16 in models[0], F32 in models[1]" in (error.details["mismatches"])
    )
    assert error.details["count"] == len(load_file(str(llama.task / "model.safetensors")))
    error = expect_incompatible(
        run_merge, {"method": "soup", "models": [llama.task, qwen2.task]}, tmp_path / "out"
    )
    assert (
        "config model_type: models[0]='llama', models[1]='qwen2'" in (error.details["mismatches"])
    )
