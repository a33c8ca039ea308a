"""The numpy kernels for linear plans: torch's arithmetic bit for bit, without importing torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.kernels import linear as linear_kernels
from engine.kernels.torch_kernels import Kernels
from engine.planner import make_plan
from engine.recipe import parse_recipe
from tests.conftest import Family
from tests.helpers import stringify


def test_bfloat16_rounding_matches_torch() -> None:
    rng = np.random.default_rng(7)
    edges = np.array(
        [
            0x00000000, 0x80000000,  # ±0
            0x3F808000, 0x3F818000,  # ties: even stays, odd rounds up
            0x3F807FFF, 0x3F808001,  # just below and above a tie
            0x7F7FFFFF, 0xFF7FFFFF,  # the largest floats round to ±inf
            0x7F800000, 0xFF800000,  # ±inf
            0x00000001, 0x807FFFFF,  # subnormals
            0x7FC00000, 0x7F800001, 0xFFFFFFFF,  # NaNs, one that carries into the sign bit
        ],
        dtype=np.uint32,
    )  # fmt: skip
    bits = np.concatenate([edges, rng.integers(0, 2**32, 1_000_000, dtype=np.uint32)])
    values = bits.view(np.float32)

    got = linear_kernels.narrow(values.copy(), "BF16").view(np.uint16)
    expected = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.uint16).numpy()

    nan = np.isnan(values)
    assert nan.sum() > 1000  # the random patterns hold NaNs too
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert (got[nan] == 0x7FC0).all()  # one canonical NaN


def _plans(fam: Family, fam32: Family) -> list[Any]:
    recipes = [
        {"method": "soup", "models": [fam.task, fam.language], "params": {"weights": [3, 7]}},
        {"method": "soup", "models": [fam.task, fam.language, fam.task2],
         "output": {"dtype": "float16"}},
        {"method": "soup", "models": [fam.task, fam.language], "output": {"dtype": "float32"}},
        {"method": "soup", "models": [fam32.task, fam32.language], "output": {"dtype": "bfloat16"}},
        # a negative coefficient: terms that cancel, rounded alike by both
        {"method": "soup", "models": [fam.task, fam.language], "params": {"weights": [1.7, -0.7]}},
        {"method": "layer_swap",
         "experts": {"task": [fam.task, fam.task2], "language": [fam.language]},
         "params": {"bottom": 1, "top": 1, "bottom_transition": 1, "top_transition": 1}},
    ]  # fmt: skip
    return [make_plan(parse_recipe(stringify(r)), resolve=Path) for r in recipes]


def test_numpy_and_torch_kernels_write_the_same_bytes(llama: Family, llama32: Family) -> None:
    for plan in _plans(llama, llama32):
        try:
            assert linear_kernels.handles(plan, "cpu")
            fast = linear_kernels.LinearKernels(plan, chunk_elements=1000)
            reference = Kernels(plan, device="cpu", chunk_elements=1000)
            computed = [t for t in plan.tensors if t.op != "copy"]
            assert computed
            for tensor in computed:
                got = b"".join(bytes(c) for c in fast.output_bytes(tensor))
                expected = b"".join(bytes(c) for c in reference.output_bytes(tensor))
                assert got == expected, tensor.name
        finally:
            plan.close()


def test_ties_and_cuda_plans_are_left_to_other_kernels(llama: Family) -> None:
    ties = {"method": "ties", "base": llama.base, "models": [llama.task, llama.language]}
    soup = {"method": "soup", "models": [llama.task, llama.language]}
    ties_plan = make_plan(parse_recipe(stringify(ties)), resolve=Path)
    soup_plan = make_plan(parse_recipe(stringify(soup)), resolve=Path)
    try:
        assert not linear_kernels.handles(ties_plan, "cpu")
        assert not linear_kernels.handles(soup_plan, "cuda")
        assert linear_kernels.handles(soup_plan, "cpu")
    finally:
        ties_plan.close()
        soup_plan.close()


@pytest.mark.parametrize("method", ["layer_swap", "soup"])
def test_a_linear_merge_does_not_import_torch(llama: Family, tmp_path: Path, method: str) -> None:
    recipes = {
        "layer_swap": {
            "method": "layer_swap",
            "experts": {"task": [str(llama.task)], "language": [str(llama.language)]},
            "params": {"bottom": 1, "top": 1},
        },
        "soup": {"method": "soup", "models": [str(llama.task), str(llama.language)]},
    }
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from engine.merge import merge
        from engine.recipe import parse_recipe

        result = merge(parse_recipe({recipes[method]!r}), Path({str(tmp_path / "out")!r}),
                       resolve=Path)
        print(len(result.files), "torch" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr
    files, torch_imported = done.stdout.split()
    assert int(files) > 3
    assert torch_imported == "False"
    assert (tmp_path / "out" / "model.safetensors").is_file()
