"""The output location: never clobbered by accident, atomic, nothing left behind on failure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import DeviceError, EngineError, MergeCanceled, OutputError
from tests.conftest import Family
from tests.helpers import leftovers
from tests.reference import load, sha256


def soup(fam: Family) -> dict[str, Any]:
    return {"method": "soup", "models": [fam.task, fam.language]}


def swap(fam: Family) -> dict[str, Any]:
    return {
        "method": "layer_swap",
        "experts": {"task": [fam.task], "language": [fam.language]},
        "params": {"bottom": 1, "top": 1, "bottom_transition": 1},
    }


def test_existing_output_is_untouched(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    (out / "model.safetensors").write_bytes(b"old weights")
    with pytest.raises(OutputError) as info:
        run_merge(soup(llama), out)
    assert info.value.code == "output_error"
    assert str(out) in info.value.message
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "model.safetensors"]
    assert (out / "keep.txt").read_text() == "precious"
    assert (out / "model.safetensors").read_bytes() == b"old weights"
    assert leftovers(out) == ["existing"]


def test_overwrite_replaces_output(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("stale")
    result = run_merge(soup(llama), out, overwrite=True, durable=True)
    assert not (out / "keep.txt").exists()
    assert (out / "model.safetensors").is_file()
    assert sha256(out / "model.safetensors") == result.files["model.safetensors"]
    assert leftovers(out) == ["existing"]  # no staging or .old- directory left


def test_empty_existing_directory_is_used(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    run_merge(soup(llama), out)
    assert (out / "layerswap.json").is_file()
    assert leftovers(out) == ["empty"]


def test_output_path_is_a_file(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    out = tmp_path / "a-file"
    out.write_text("not a directory")
    with pytest.raises(OutputError):
        run_merge(soup(llama), out, overwrite=True)
    assert out.read_text() == "not a directory"


# Checks happen between chunks and once per writer thread while the writes drain; an hour-long
# drain tick makes their number independent of timing.
_DETERMINISTIC: dict[str, Any] = {"chunk_elements": 4096, "drain_tick_s": 3600.0}


def _count_checks(run_merge: Any, recipe: dict[str, Any], tmp_path: Path) -> int:
    calls = 0

    def count() -> bool:
        nonlocal calls
        calls += 1
        return False

    run_merge(recipe, tmp_path / "counted", should_cancel=count, **_DETERMINISTIC)
    return calls


@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_cancellation_leaves_nothing(
    at: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    recipe = swap(llama)
    total = _count_checks(run_merge, recipe, tmp_path)
    assert total > 10
    stop_after = {"first": 0, "middle": total // 2, "last": total - 1}[at]
    calls = 0

    def cancel() -> bool:
        nonlocal calls
        calls += 1
        return calls > stop_after

    out = tmp_path / "canceled"
    with pytest.raises(MergeCanceled) as info:
        run_merge(recipe, out, should_cancel=cancel, **_DETERMINISTIC)
    assert info.value.code == "canceled"
    assert calls == stop_after + 1  # stopped at the first True
    assert leftovers(out) == []


def test_input_failure_mid_merge_leaves_nothing(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """An input truncated after planning (here: by the cancel hook) fails the merge cleanly."""
    import shutil

    language = tmp_path / "language"
    shutil.copytree(llama.language, language)
    weights = language / "model.safetensors"
    calls = 0

    def truncate_on_third_call() -> bool:
        nonlocal calls
        calls += 1
        if calls == 3:
            os.truncate(weights, 64)
        return False

    out = tmp_path / "out"
    recipe = {
        "method": "layer_swap",
        "experts": {"task": [llama.task], "language": [language]},
        "params": {"bottom": 6, "top": 0, "non_layer": "average"},
    }
    with pytest.raises(EngineError) as info:
        run_merge(recipe, out, should_cancel=truncate_on_third_call)
    assert "truncated" in info.value.message or "ended" in info.value.message
    assert leftovers(out) == []


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device(device: str, llama: Family, run_merge: Any, tmp_path: Path) -> None:
    """No GPU: a clear DeviceError and no output. With a GPU: the same bytes as on CPU."""
    out = tmp_path / "gpu"
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError) as info:
            run_merge(swap(llama), out, device=device)
        assert info.value.code == "device_unavailable"
        assert "cuda" in info.value.message.lower() and "GPU" in info.value.message
        assert leftovers(out) == []
        return
    gpu = run_merge(swap(llama), out, device=device)
    cpu = run_merge(swap(llama), tmp_path / "cpu")
    gpu_tensors, cpu_tensors = load(gpu.out_dir), load(cpu.out_dir)
    for name, tensor in cpu_tensors.items():
        torch.testing.assert_close(gpu_tensors[name], tensor, rtol=0, atol=0, msg=name)


def test_unknown_device(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    out = tmp_path / "tpu"
    with pytest.raises(DeviceError) as info:
        run_merge(soup(llama), out, device="tpu")
    assert "tpu" in info.value.message
    assert leftovers(out) == []
