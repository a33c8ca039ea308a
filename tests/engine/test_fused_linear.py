"""The compiled linear kernels against the torch kernels (the reference), bit for bit, on
hand-made inputs: every dtype, odd sizes, 1-5 terms (two of one dtype on a loop of their own),
negative and zero coefficients, NaN, ±inf, ±0.0, subnormals and values that round to infinity."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.io.checkpoint import Checkpoint
from engine.kernels import linear as linear_kernels
from engine.kernels.torch_kernels import Kernels
from engine.plan.model import Plan, Shard, TensorPlan, Term

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# odd sizes: below and above the threads' split (65536), not multiples of the vector width
SIZES = {"one": (1,), "seven": (7,), "rows": (3, 171), "split": (5, 26215)}
COEFFICIENTS = [0.3, -1.25, 1.0, 0.0, 1 / 3, -0.7]
EDGES = [
    float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -3e-39, 6e-8, 65504.0,
    65520.0, -70000.0, 3e38, -3e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 2**-14, -(2**-24),
]  # fmt: skip


def _values(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Normal values with every edge case sprinkled in (all representable in `dtype` or
    rounded to it, as a checkpoint would hold them)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    values = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-3, 1.0, 300.0], n)
    edges = np.array(EDGES, np.float32)
    spots = rng.choice(n, min(n, 40), replace=False)
    values[spots] = edges[rng.integers(0, edges.size, spots.size)]
    return torch.from_numpy(values).reshape(shape).to(DTYPES[dtype])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Five checkpoints; each holds every size in every dtype, as `<size>.<dtype>`, and
    `mixed`, whose dtype differs from model to model."""
    made = []
    for model in range(5):
        directory = tmp_path_factory.mktemp(f"model{model}")
        (directory / "config.json").write_text(json.dumps({"model_type": "synthetic"}))
        tensors = {
            f"{size}.{dtype}": _values(shape, dtype, seed=model * 100 + i)
            for i, ((size, shape), dtype) in enumerate(itertools.product(SIZES.items(), DTYPES))
        }
        tensors["mixed"] = _values(SIZES["split"], list(DTYPES)[model % 3], seed=model)
        save_file(tensors, str(directory / "model.safetensors"))
        made.append(directory)
    return made


def _plan(paths: list[Path], tensors: list[TensorPlan]) -> Plan:
    return Plan(
        method="synthetic", inputs=(), tensors=tuple(tensors),
        shards=(Shard("model.safetensors", tuple(range(len(tensors)))),), num_layers=None,
        config_input=0, tokenizer_input=0, checkpoints=[Checkpoint.open(p) for p in paths],
    )  # fmt: skip


def _tensor(
    op: str, input_name: str, out: str, terms: list[tuple[int, float]], index: int
) -> TensorPlan:
    shape = SIZES[input_name.split(".")[0]] if "." in input_name else SIZES["split"]
    return TensorPlan(
        name=f"out{index}", shape=shape, dtype=out, op=op,  # type: ignore[arg-type]
        terms=tuple(Term(source, c) for source, c in terms), layer=None, origin="test",
        input_name=input_name,
    )  # fmt: skip


def _compare(plan: Plan, chunk_elements: int) -> None:
    assert linear_kernels.handles(plan, "cpu")
    compiled = linear_kernels.LinearKernels(plan, chunk_elements=chunk_elements)
    reference = Kernels(plan, device="cpu", chunk_elements=chunk_elements)
    for tensor in plan.tensors:
        got = b"".join(bytes(c) for c in compiled.output_bytes(tensor))
        expected = b"".join(bytes(c) for c in reference.output_bytes(tensor))
        assert len(got) == tensor.nbytes
        _same(got, expected, tensor.dtype)


def _same(got: bytes, expected: bytes, dtype: str) -> None:
    """Bit for bit, except that NaNs need only both be NaN (payloads may differ)."""
    if got == expected:
        return
    view = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
    a = torch.frombuffer(bytearray(got), dtype=view).float()
    b = torch.frombuffer(bytearray(expected), dtype=view).float()
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), "NaN in different places"
    bits = {"BF16": torch.int16, "F16": torch.int16, "F32": torch.int32}[dtype]
    a_bits = torch.frombuffer(bytearray(got), dtype=bits)[~nan]
    b_bits = torch.frombuffer(bytearray(expected), dtype=bits)[~nan]
    differ = (a_bits != b_bits).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} elements differ, first at {differ[:5]}"


def _cases() -> list[tuple[str, str, str, str, list[float]]]:
    """(op, input dtype, output dtype, size, coefficients): every op × input × output dtype,
    with 1 to 5 terms and sizes and coefficients rotating through their lists."""
    cases = []
    for i, (op, source, out) in enumerate(
        itertools.product(["linear", "weighted_sum", "weighted_mean"], DTYPES, DTYPES)
    ):
        terms = 1 + i % 5
        coefficients = [COEFFICIENTS[(i + j) % len(COEFFICIENTS)] for j in range(terms)]
        if op == "weighted_mean" and sum(coefficients) == 0.0:
            coefficients[0] = 2.0  # the planner refuses weights that sum to zero
        cases.append((op, source, out, list(SIZES)[i % len(SIZES)], coefficients))
    return cases


@pytest.mark.parametrize("chunk_elements", [1000, 1 << 21])
@pytest.mark.parametrize(("op", "source", "out", "size", "coefficients"), _cases())
def test_compiled_and_torch_kernels_write_the_same_bytes(
    inputs: list[Path], op: str, source: str, out: str, size: str, coefficients: list[float],
    chunk_elements: int,
) -> None:  # fmt: skip
    terms = list(enumerate(coefficients))
    tensors = [_tensor(op, f"{name}.{source}", out, terms, i) for i, name in enumerate(SIZES)]
    plan = _plan(inputs, tensors)
    try:
        _compare(plan, chunk_elements)
    finally:
        plan.close()


PAIRS = [(1.0, 1.0), (0.3, -1.25), (1.0, 0.0), (1 / 3, -0.7), (-0.7, 1.0)]


@pytest.mark.parametrize("chunk_elements", [1000, 1 << 21])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["linear", "weighted_sum", "weighted_mean"])
def test_two_terms_stored_as_the_output_write_the_same_bytes(
    inputs: list[Path], op: str, dtype: str, chunk_elements: int
) -> None:
    """Two terms stored in the output's dtype (a soup of two models, a layer swap's averages)
    take a loop of their own: every size with every pair of coefficients, NaN and the other
    edges included, against torch."""
    cases = itertools.product(SIZES, PAIRS)
    tensors = [
        _tensor(op, f"{size}.{dtype}", dtype, [(0, c0), (3, c1)], i)
        for i, (size, (c0, c1)) in enumerate(cases)
    ]
    plan = _plan(inputs, tensors)
    try:
        _compare(plan, chunk_elements)
    finally:
        plan.close()


def test_terms_of_different_dtypes(inputs: list[Path]) -> None:
    """A tensor whose inputs differ in dtype (BF16, F32 and F16 checkpoints souped)."""
    terms = [(0, 0.7), (1, -0.2), (2, 0.5), (3, 1.0), (4, 0.25)]
    ops = [("linear", "F32"), ("linear", "BF16"), ("weighted_mean", "F16")]
    plan = _plan(inputs, [_tensor(op, "mixed", out, terms, i) for i, (op, out) in enumerate(ops)])
    try:
        assert {c.tensors["mixed"].dtype for c in plan.checkpoints} == set(DTYPES)
        _compare(plan, 1 << 16)
    finally:
        plan.close()


def test_mean_divisor_is_summed_as_torch_sums_it() -> None:
    """Sums of up to 7 coefficients in torch's order (which is not left to right for 5-7)."""
    rng = np.random.default_rng(5)
    for _ in range(3000):
        n = int(rng.integers(1, linear_kernels.MEAN_TERMS))
        values = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 5, n)).astype(np.float32)
        expected = torch.from_numpy(values).reshape(1, -1).sum(dim=1).numpy()[0]
        assert linear_kernels.row_sum(values).view(np.uint32) == expected.view(np.uint32)


def test_means_of_many_terms_are_left_to_torch(inputs: list[Path]) -> None:
    """From 8 terms on torch sums the divisor in vector lanes, whose width depends on the CPU."""

    def plan_with(op: str, terms: int) -> Plan:
        spec = [(j % 5, 1.0) for j in range(terms)]
        return _plan(inputs, [_tensor(op, "seven.F32", "F32", spec, 0)])

    cases: list[tuple[Any, bool]] = [
        (plan_with("weighted_mean", 7), True),
        (plan_with("weighted_mean", 8), False),
        (plan_with("weighted_sum", 8), True),
        (plan_with("linear", 9), True),
    ]
    for plan, handled in cases:
        try:
            assert linear_kernels.handles(plan, "cpu") is handled
            assert not linear_kernels.handles(plan, "cuda")
        finally:
            plan.close()


@pytest.mark.parametrize("dtype", ["F16", "F32"])
def test_narrowing_matches_torch(dtype: str) -> None:
    """float32 → F16 (F32: as is) over edge patterns and a million random ones."""
    edges = np.array(
        [0x00000000, 0x80000000, 0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FE000,
         0x387FF000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x7F800000, 0xFF800000, 0x3F801000,
         0x3F803000, 0x3F801001, 0x00000001, 0x807FFFFF],
        dtype=np.uint32,
    )  # fmt: skip
    rng = np.random.default_rng(9)
    bits = np.concatenate([edges, rng.integers(0, 2**32, 1_000_000, dtype=np.uint32)])
    values = bits.view(np.float32)
    got = linear_kernels.narrow(values.copy(), dtype)
    expected = torch.from_numpy(values.copy()).to(DTYPES[dtype]).numpy()
    _same(got.tobytes(), expected.tobytes(), dtype)
