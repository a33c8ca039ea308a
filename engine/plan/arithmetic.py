"""The dtype each planned tensor is computed in: from the recipe's `arithmetic` and the dtypes
of the inputs it reads, as mergekit 0.1.5 picks it from its config's `dtype`.

mergekit rounds its inputs to `dtype`, computes, and rounds the result to `dtype` before
writing it in `out_dtype`. Its linear and slerp compute in float32 (float64 for float64) whatever
`dtype` is; everything else computes in `dtype` itself, each step rounded to it. Torch-free: the
planner and the compiled kernels ask it too (the compiled kernels compute float32 only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.plan.model import Plan, TensorPlan

NARROW = frozenset({"BF16", "F16"})  # computed in, these are mergekit's arithmetic only
_NAMES = {"float32": "F32", "float64": "F64", "bfloat16": "BF16", "float16": "F16"}
# Ops whose mergekit counterparts (linear, slerp) compute in float32 from inputs rounded to
# `dtype`; Layerswap's own linear ops (soups, layer swaps, conversions) are taken as they are.
FLOAT32_OPS = frozenset({"linear", "weighted_sum", "weighted_mean", "slerp"})
# Ops whose mergekit result is wider than `dtype` and is written so, not rounded to it:
# arcee_fusion's base + change·mask with a float32 mask is float32, and so is ramplus_tl's sum
# with its float32 λ.
WIDE_RESULTS = frozenset({"arcee_fusion", "ramplus_tl"})


@dataclass(frozen=True)
class TensorArithmetic:
    """How one tensor is computed: `rounded`, the narrow dtype its inputs and result are
    rounded to (None: none); `compute`, the dtype its operations run in; `result_rounded`,
    whether the result is rounded to `rounded` too (else written as computed)."""

    rounded: str | None
    compute: str
    result_rounded: bool = True


def compute_dtype(arithmetic: str, dtypes: Iterable[str]) -> str:
    """The dtype a tensor with inputs of `dtypes` is computed in."""
    found = set(dtypes)
    if arithmetic == "float32":
        return "F64" if "F64" in found else "F32"
    if arithmetic == "source":  # mergekit's promotion: one dtype as it is, mixed ones widened
        if len(found) == 1:
            return found.pop()
        return "F64" if "F64" in found else "F32"
    return _NAMES[arithmetic]


def keeps(arithmetic: str, dtype: str) -> bool:
    """Whether rounding a value of `dtype` to the arithmetic's dtype leaves it as it is."""
    wide = compute_dtype(arithmetic, [dtype])
    return wide == dtype or wide == "F64" or (wide == "F32" and dtype != "F64")


def input_dtypes(plan: Plan, tensor: TensorPlan) -> list[str]:
    return [
        plan.checkpoints[source].tensors[tensor.read_name].dtype
        for source in sorted(plan.inputs_read(tensor))
    ]


def tensor_arithmetic(plan: Plan, tensor: TensorPlan) -> TensorArithmetic:
    dtypes = input_dtypes(plan, tensor)
    dtype = compute_dtype(plan.arithmetic, dtypes)
    if dtype not in NARROW:
        return TensorArithmetic(None, dtype)
    if tensor.op not in FLOAT32_OPS:
        return TensorArithmetic(dtype, dtype, tensor.op not in WIDE_RESULTS)
    if set(dtypes) == {dtype} and tensor.dtype == dtype:  # rounding to it changes nothing
        return TensorArithmetic(None, "F32")
    return TensorArithmetic(dtype, "F32")


def as_float32(plan: Plan) -> bool:
    """Whether every tensor the plan computes is computed as arithmetic float32 computes it
    (what the compiled CPU kernels do)."""
    if plan.arithmetic == "float32":
        return True
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        usual = TensorArithmetic(None, compute_dtype("float32", input_dtypes(plan, tensor)))
        if tensor_arithmetic(plan, tensor) != usual:
            return False
    return True
