"""The compiled bf16/fp16 task arithmetic and TIES (engine/kernels/narrow.py) against the torch
operations they fuse (narrow_torch.NarrowTaskVectors.chunk, mergekit's own steps): the same bits
on random deltas with the awkward cases in them: signed zeros, tied magnitudes at the cut,
sums that cancel or underflow in fp16, NaN-free extremes; and the torch-free glue of task
arithmetic (narrow_arithmetic.py) against torch's."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from engine.kernels.narrow_arithmetic import MAX_TERMS, ZERO_DIVISOR, rounded, summed
from engine.kernels.narrow_torch import NarrowTaskVectors, sorted_mask
from engine.kernels.top_k import top_k
from engine.plan.model import TensorPlan, Term, TiesSettings
from tests.conftest import Family

COUNT = 4096


def inputs(dtype: torch.dtype, models: int, seed: int) -> list[torch.Tensor]:
    """A base and `models` fine-tunes: small deltas, some exactly zero or cancelling."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(COUNT, generator=generator) * 0.02
    base[:64] = 0.0
    base[64:96] = -0.0
    found = [base.to(dtype)]
    for i in range(models):
        delta = torch.randn(COUNT, generator=generator) * 1e-3 * (i + 1)
        delta[::7] = 0.0
        delta[::11] = 1e-8 if dtype == torch.float16 else 1e-30  # underflows
        delta[100:200] = (-1) ** i * 5e-4  # cancels between models: ties and elections
        found.append((base + delta).to(dtype))
    return found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("op", "weights", "density", "normalize", "lambda_", "sorted_"),
    [("task_arithmetic", [0.7, -0.3, 0.45], 1.0, True, 1.3, False),
     ("task_arithmetic", [1.0, 1.0], 1.0, False, 1.0, False),
     ("ties", [0.7, 0.3, 0.5], 0.5, True, 1.2, False),
     ("ties", [1.0, 0.6], 0.3, False, 1.0, True),
     ("ties", [0.2, 1.0, 0.9], 1.0, True, 0.8, False)],
)  # fmt: skip
def test_the_compiled_kernel_is_torchs_bit_for_bit(
    dtype: torch.dtype, op: str, weights: list[float], density: float, normalize: bool,
    lambda_: float, sorted_: bool,
) -> None:  # fmt: skip
    xs = inputs(dtype, len(weights), seed=len(weights) + int(density * 10))
    terms = tuple(Term(i + 1, w) for i, w in enumerate(weights))
    tensor = TensorPlan("t", (COUNT,), "BF16", op, terms, 0, op)  # type: ignore[arg-type]
    settings = TiesSettings(0, density, lambda_, normalize)

    def read(source: int, start: int, count: int) -> torch.Tensor:
        return xs[source][start : start + count].clone()

    def magnitudes(source: int) -> list[torch.Tensor]:
        return [(xs[source] - xs[0]).abs().float()]

    selections = [None] * len(weights)
    if op == "ties" and density < 1.0:
        k = settings.kept(COUNT)
        selections = [
            sorted_mask(magnitudes(t.source), COUNT, (0, k), descending=True) if sorted_
            else top_k(lambda t=t: iter(magnitudes(t.source)), k, numel=COUNT, in_memory=COUNT)
            for t in terms
        ]  # fmt: skip
    reference = NarrowTaskVectors(read, tensor, settings, list(selections))
    compiled = NarrowTaskVectors(read, tensor, settings, list(selections))
    for start in range(0, COUNT, 1000):  # chunks in order: the tie quotas carry over
        count = min(1000, COUNT - start)
        expected, got = reference.chunk(start, count), compiled.compiled_chunk(start, count)
        assert got.dtype == expected.dtype == dtype
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), start
    assert compiled.ties_left == reference.ties_left
    assert not math.isnan(float(got.float().sum()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_torch_free_weights_and_divisor_are_torchs(dtype: torch.dtype) -> None:
    """narrow_arithmetic.py rounds the weights and sums them without torch: the same values as
    torch's (NarrowTaskVectors' constants) for 1 to 15 models, with weights that round to a
    tie, cancel to zero, or overflow fp16 or float32 (quietly, as torch)."""
    generator = torch.Generator().manual_seed(7)
    f16 = dtype == torch.float16
    awkward = [1 + 2**-8, 1 + 3 * 2**-9, 0.1, -0.1, 1e-9, 70000.0, 1 / 3, 1e39]
    # a double just past a bf16 tie that float32 rounds onto it; sums that float32 leaves at a
    # tie (each 2^-24 lost) where a wider sum passes it
    cases = [[1 + 2**-8 + 2**-40], [1.0, 2**-8, 2**-24, 2**-24], [1.0, 2**-11, 2**-24, 2**-24]]
    for count in range(1, MAX_TERMS):
        for trial in range(80):
            weights = (torch.randn(count, generator=generator) * 10 ** (trial % 4 - 2)).tolist()
            if trial % 2:  # spread over many binades, nearly cancelling: the order shows
                scale = torch.pow(2.0, torch.randint(-14, 12, (count,), generator=generator))
                weights = (torch.randn(count, generator=generator) * scale).tolist()
                weights[-1] = -sum(weights[:-1]) * (1 + 1e-3 * trial)
            if trial % 5 == 0:
                weights = [awkward[(trial + i) % len(awkward)] for i in range(count)]
            if trial % 7 == 0 and count > 1:
                weights[-1] = -sum(weights[:-1])  # about zero in all
            if trial < len(cases):
                weights = cases[trial]
            terms = tuple(Term(i + 1, w) for i, w in enumerate(weights))
            tensor = TensorPlan("w", (1,), "F16" if f16 else "BF16", "task_arithmetic", terms,
                                None, "task_arithmetic")  # fmt: skip
            settings = TiesSettings(base=0, density=1.0, lambda_=1.0, normalize=True)
            column, divisor = NarrowTaskVectors(None, tensor, settings, [])._constants(dtype)  # type: ignore[arg-type]
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                mine = [rounded(w, f16) for w in weights]
                total = summed(mine, f16)
            assert str(mine) == str(column.tolist()), weights  # str: nan equals nan
            made = 1.0 if abs(total) < rounded(ZERO_DIVISOR, f16) else total
            assert str(made) == str(divisor), weights


def test_bfloat16_task_arithmetic_does_not_import_torch(llama: Family, tmp_path: Path) -> None:
    """A bf16 config's task arithmetic over bf16 checkpoints is computed by the compiled
    kernel alone (the same bits as mergekit's: test_mergekit_arithmetic.py)."""
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(llama.base),
        "models": [{"model": str(llama.task), "parameters": {"weight": 0.7}},
                   {"model": str(llama.language), "parameters": {"weight": 0.4}}],
        "parameters": {"normalize": True, "lambda": 0.9},
        "dtype": "bfloat16",
    }  # fmt: skip
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from engine.merge import merge
        from engine.mergekit import translate

        recipe = translate({config!r}, is_local=lambda s: Path(s).is_dir()).recipe
        result = merge(recipe, Path({str(tmp_path / "out")!r}), resolve=Path)
        print(len(result.files), "torch" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr
    files, torch_imported = done.stdout.split()
    assert int(files) > 3
    assert torch_imported == "False"
