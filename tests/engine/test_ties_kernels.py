"""The compiled TIES kernels: torch's TIES bit for bit, an exact top-k, no torch import."""

from __future__ import annotations

import math
import multiprocessing
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.kernels import ties as ties_kernels
from engine.kernels.torch_kernels import Kernels
from engine.planner import make_plan
from engine.recipe import parse_recipe
from tests.conftest import Family, _family
from tests.helpers import stringify
from tests.reference import kept_count, top_k_mask


@pytest.fixture(scope="module")
def llama16(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """float16 inputs (widened by numpy, not bit-shifted as BF16 is)."""
    return _family(tmp_path_factory.mktemp("llama16"), dtype=torch.float16, layers=2, seed=30)


def _recipes(fam: Family, fam32: Family, fam16: Family) -> list[dict[str, Any]]:
    def ties(f: Family, models: list[Path], **extra: Any) -> dict[str, Any]:
        return {"method": "ties", "base": f.base, "models": models, **extra}

    pair, pair32 = [fam.task, fam.language], [fam32.task, fam32.language]
    return [
        ties(fam, pair),
        ties(fam, [fam.task, fam.language, fam.language2],
             params={"density": 0.4, "weights": [0.3, 1.0, 2.0], "lambda": 0.9}),
        ties(fam, pair, params={"density": 1.0, "normalize": False, "lambda": 0.6}),
        ties(fam, pair, params={"density": 0.5, "normalize": False, "weights": [0.2, 0.9]}),
        ties(fam, pair, output={"dtype": "float16"}),
        ties(fam, pair, output={"dtype": "float32"}),
        ties(fam32, pair32, params={"density": 0.3, "weights": [1.0, 0.5], "lambda": 1.4}),
        ties(fam32, pair32, output={"dtype": "bfloat16"}),
        ties(fam16, [fam16.task, fam16.language], params={"density": 0.7}),
        # weights and densities per model, by layer and tensor: 0, negative, kept whole
        ties(fam, [fam.task, fam.language, fam.language2], params={
            "weights": [[0.0, 1.0], [{"filter": "mlp", "value": -0.4}, {"value": 0.8}], 0.5],
            "density": [[1.0, 0.3], 0.5, [{"filter": "self_attn", "value": 1.0}, {"value": 0.2}]],
        }),
        ties(fam32, pair32, params={"weights": [[0.5, 0.0], 1.2], "density": [0.4, [0.9, 0.1]]}),
    ]  # fmt: skip


def _bytes(kernels: Any, tensor: Any) -> bytes:
    return b"".join(bytes(chunk) for chunk in kernels.output_bytes(tensor))


@pytest.mark.parametrize("chunk_elements", [1000, 1 << 20])
def test_compiled_and_torch_kernels_write_the_same_bytes(
    llama: Family, llama32: Family, llama16: Family, chunk_elements: int
) -> None:
    """1000-element chunks send the larger tensors down the chunked selection (their |δ|
    computed again for each pass, ties across chunk borders); 1M keeps every tensor whole."""
    for recipe in _recipes(llama, llama32, llama16):
        plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
        try:
            assert ties_kernels.handles(plan, "cpu")
            compiled = ties_kernels.TiesKernels(plan, chunk_elements=chunk_elements)
            reference = Kernels(plan, device="cpu", chunk_elements=chunk_elements)
            computed = [t for t in plan.tensors if t.op == "ties"]
            assert any(math.prod(t.shape) > 8 * chunk_elements for t in computed) == (
                chunk_elements == 1000
            )
            for tensor in computed:
                assert _bytes(compiled, tensor) == _bytes(reference, tensor), (recipe, tensor.name)
        finally:
            plan.close()


def _kept(select: Callable[..., tuple[int, int]], delta: np.ndarray, k: int, step: int) -> Any:
    """The keep mask the kernels apply, from the selection's (threshold, cutoff)."""
    model, base = delta.astype(np.float32), np.zeros(delta.size, np.float32)
    threshold, cutoff = select(
        delta.size, k, step, lambda start, count: (model[start:][:count], base[start:][:count])
    )
    bits = np.abs(model).view(np.uint32)
    index = np.arange(delta.size)
    return (bits > threshold) | ((bits == threshold) & (index < cutoff))


@pytest.mark.parametrize("step", [100_000, 1000, 37])
def test_selection_is_the_exact_top_k_first_ties_in_flat_order(llama: Family, step: int) -> None:
    """The stable-sort reference keeps exactly k entries, the first of equal ones in flat
    order; so must the radix selection, kept whole or recomputed chunk by chunk."""
    rng = np.random.default_rng(3)
    cases = {
        "gaussian": rng.standard_normal(20_000) * 0.01,
        "few values, many ties": rng.integers(-3, 4, 20_000) * 0.5,
        "all equal": np.full(5000, -0.25),
        "zeros and a spike": np.where(np.arange(5000) == 4321, 2.0, 0.0),
        "subnormals": rng.integers(-5, 6, 3000) * 1e-44,
    }
    recipe = {"method": "ties", "base": llama.base, "models": [llama.task]}
    plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
    try:
        kernels = ties_kernels.TiesKernels(plan, chunk_elements=step)
        for name, delta in cases.items():
            magnitude = torch.from_numpy(np.abs(delta.astype(np.float32)))
            for density in (1e-4, 0.3, 0.5, 0.999, 1.0):
                k = kept_count(density, delta.size)
                got = _kept(kernels._select, delta, k, step)
                expected = top_k_mask(magnitude, density).numpy()
                assert int(got.sum()) == k, (name, density)
                np.testing.assert_array_equal(got, expected, err_msg=f"{name} {density}")
    finally:
        plan.close()


def test_nan_reaches_the_output() -> None:
    """A NaN delta is not dropped by the sign election: that element's output is NaN (as
    with the torch kernels), written as the canonical BF16 NaN; the others are finite."""
    base = np.zeros(8, np.float32)
    terms = np.array([[0.5, -0.5, np.nan, 1, 0, 0, 0, 2], [0.25] * 8], np.float32)
    out = np.empty(8, np.uint16)
    ones, zeros = np.ones(2, np.float32), np.zeros(2, np.uint32)
    ties_kernels._combine(
        base, terms, 0, ones, zeros, np.zeros(2, np.int64), False, True, np.float32(1), out, 0, 8
    )
    assert out[2] == 0x7FC0
    values = (out.astype(np.uint32) << 16).view(np.float32)
    assert np.isfinite(np.delete(values, 2)).all()
    assert values[0] == np.float32(0.375)  # (0.5 + 0.25) / 2: both agree
    assert values[1] == np.float32(-0.5)  # the sum -0.25 elects −: only the −0.5 counts


def test_only_cpu_ties_plans_are_compiled(llama: Family) -> None:
    ties = {"method": "ties", "base": llama.base, "models": [llama.task, llama.language]}
    soup = {"method": "soup", "models": [llama.task, llama.language]}
    ties_plan = make_plan(parse_recipe(stringify(ties)), resolve=Path)
    soup_plan = make_plan(parse_recipe(stringify(soup)), resolve=Path)
    try:
        assert ties_kernels.handles(ties_plan, "cpu")
        assert not ties_kernels.handles(ties_plan, "cuda")
        assert not ties_kernels.handles(soup_plan, "cpu")
    finally:
        ties_plan.close()
        soup_plan.close()


def test_a_ties_merge_does_not_import_torch(llama: Family, tmp_path: Path) -> None:
    recipe = {
        "method": "ties",
        "base": str(llama.base),
        "models": [str(llama.task), str(llama.language)],
    }
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from engine.merge import merge
        from engine.recipe import parse_recipe

        result = merge(parse_recipe({recipe!r}), Path({str(tmp_path / "out")!r}), resolve=Path)
        print(len(result.files), "torch" in sys.modules)
        """
    )
    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr
    files, torch_imported = done.stdout.split()
    assert int(files) > 3
    assert torch_imported == "False"


def test_a_forked_child_computes_with_threads_of_its_own(llama: Family) -> None:
    """A prefork worker forks after its parent may have merged: the parent's helper threads
    do not exist in the child, so the child must not wait on them."""
    recipe = {"method": "ties", "base": llama.base, "models": [llama.task, llama.language]}
    plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
    try:
        kernels = ties_kernels.TiesKernels(plan, chunk_elements=1 << 20)
        tensor = next(t for t in plan.tensors if t.op == "ties")
        expected = _bytes(kernels, tensor)  # the parent's helper threads now exist
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        child = context.Process(target=lambda: results.put(_bytes(kernels, tensor)))
        child.start()
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
        assert child.exitcode == 0, "the child hung or failed"
        assert results.get(timeout=5) == expected
    finally:
        plan.close()
