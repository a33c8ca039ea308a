"""What nuslerp and model_stock read and measure, without torch: which inputs, which vectors
their angles are taken between, which pairs' moments Σ vᵢ·vⱼ they need, and model_stock's
coefficients from those moments.

angle_torch.py adds the torch arithmetic (mergekit's own operations, for its bytes) to these. The
compiled CPU kernels (angle.py) work from this module alone for a tensor measured by
its moments, so such tensors are merged while torch, which takes a second to import, loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.plan.model import TensorPlan

NORM_FLOOR = 1e-7  # nuslerp: a vector of a smaller norm is divided by this instead
COLINEAR = 1e-16  # nuslerp: 1 − cos²θ at or below this interpolates linearly
PRODUCT_FLOOR = 1e-6  # model_stock: ‖δᵢ‖·‖δⱼ‖ below this divides by this instead
SINGULAR = 1e-6  # model_stock: |1 + (N − 1) cos θ| below this keeps the base (t = 0)

Pair = tuple[int, int]


@dataclass(frozen=True)
class Vectors:
    """A tensor seen as a [rows, length] matrix whose rows, or with `columns` its columns,
    are the vectors the angles are measured between."""

    rows: int
    length: int
    columns: bool = False


def vectors_of(op: str, shape: tuple[int, ...]) -> Vectors:
    numel = math.prod(shape)
    if op == "nuslerp_columns" and len(shape) >= 2 and numel:
        return Vectors(shape[0], numel // shape[0], columns=True)
    if op in ("nuslerp_rows", "model_stock_rows") and len(shape) >= 2 and numel:
        return Vectors(numel // shape[-1], shape[-1])
    return Vectors(1, numel)  # the whole tensor; a 0-D or 1-D one is a single row or column


class NuslerpTerms:
    """Terms (a, 1 − t), (b, t)[, (base, 1)]: slerp of a and b, or of their task vectors."""

    pairs: tuple[Pair, ...] = ((0, 0), (1, 1), (0, 1))
    vectors = 2  # a and b, or their differences from the base

    def __init__(self, tensor: TensorPlan) -> None:
        self.sources = tuple(term.source for term in tensor.terms)
        self.t = tensor.terms[1].coefficient
        self.with_base = len(tensor.terms) == 3

    @property
    def from_base(self) -> bool:
        """Whether the angles are between task vectors (a − base, b − base)."""
        return self.with_base


class ModelStockTerms:
    """Terms (model_i, 1/N)…, (base, 1): the models' average, pulled to the base."""

    from_base = True  # angles between task vectors

    def __init__(self, tensor: TensorPlan) -> None:
        self.sources = tuple(term.source for term in tensor.terms)
        self.count = len(self.sources) - 1
        n = self.count
        self.pairs: tuple[Pair, ...] = tuple((i, i) for i in range(n)) + tuple(
            (i, j) for i in range(n) for j in range(i + 1, n)
        )

    @property
    def vectors(self) -> int:
        """The task vectors whose angles count: one per model."""
        return self.count

    def table_from_moments(self, moments: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
        """[[t], [1 − t]] (float32) for one vector from its moments (in `pairs` order): the
        mean cos θ over pairs in float64, then t = N·cos / (1 + (N − 1)·cos) in float32, the
        steps and dtypes of angles.ModelStock (IEEE operations only, so the same bits)."""
        index = {pair: k for k, pair in enumerate(self.pairs)}
        n = self.count
        cosines = []
        for i in range(n):
            for j in range(i + 1, n):
                product = math.sqrt(moments[index[i, i]]) * math.sqrt(moments[index[j, j]])
                cosine = moments[index[i, j]] / max(product, PRODUCT_FLOOR)
                cosines.append(min(max(cosine, -1.0), 1.0))
        cos = np.float32(sum(cosines) / len(cosines))
        denominator = np.float32(1) + np.float32(n - 1) * cos
        t = np.float32(0) if abs(denominator) < SINGULAR else np.float32(n) * cos / denominator
        return np.array([[t], [np.float32(1) - t]], np.float32)


Terms = NuslerpTerms | ModelStockTerms
TERMS: dict[str, type[Terms]] = {
    "nuslerp": NuslerpTerms, "nuslerp_rows": NuslerpTerms, "nuslerp_columns": NuslerpTerms,
    "model_stock": ModelStockTerms, "model_stock_rows": ModelStockTerms,
}  # fmt: skip
