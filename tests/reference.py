"""Independent, deliberately naive reference implementations and file helpers for the tests.

Nothing here imports the engine: the reference reads checkpoints with `safetensors.torch`
(or parses the raw header with `json`/`struct`) and computes the formulas of docs/concepts/
("Semantics, precisely") directly on whole tensors in memory, so an engine bug cannot hide
behind a shared helper.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

Tensors = dict[str, torch.Tensor]

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


# -- reading checkpoints ----------------------------------------------------------------------
def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({directory / name for name in weight_map.values()})
    return sorted(directory.glob("*.safetensors"))


def load(directory: Path) -> Tensors:
    """Every tensor of a checkpoint directory, over all its shards."""
    tensors: Tensors = {}
    for file in weight_files(directory):
        found = load_file(str(file))
        assert not set(found) & set(tensors), f"tensor in two shards of {directory}"
        tensors.update(found)
    return tensors


def read_header(file: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """(header entries without __metadata__, absolute offset of the data region)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def raw_tensors(directory: Path) -> dict[str, bytes]:
    """The stored bytes of every tensor, straight from the files (no decoding)."""
    out: dict[str, bytes] = {}
    for file in weight_files(directory):
        header, data_start = read_header(file)
        blob = file.read_bytes()
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            out[name] = blob[data_start + begin : data_start + end]
    return out


def header_dtypes(directory: Path) -> dict[str, str]:
    dtypes: dict[str, str] = {}
    for file in weight_files(directory):
        header, _ = read_header(file)
        dtypes.update({name: entry["dtype"] for name, entry in header.items()})
    return dtypes


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- layer swap -------------------------------------------------------------------------------
def layer_of(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def swap_region(layer: int, num_layers: int, b: int, u: int, tb: int, tu: int) -> str:
    """The layer-swap rule (docs/concepts/layer-swap.md), written out from the two ends inwards."""
    if layer < b or layer >= num_layers - u:
        return "language"
    if layer < b + tb or layer >= num_layers - u - tu:
        return "transition"
    return "task"


def combine(coefficients: Sequence[float], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ c_i·T_i accumulated in float32, in order (not rounded)."""
    acc = coefficients[0] * tensors[0].float()
    for c, t in zip(coefficients[1:], tensors[1:], strict=True):
        acc = acc + c * t.float()
    return acc


# -- magnitude weights (docs/concepts/layer-swap.md) -------------------------------------
def magnitude(expert: Tensors, base: Tensors) -> float:
    """Mean over every 1-D/2-D tensor's row MAVs of |expert − base| (a 1-D tensor is one row)."""
    row_mavs = []
    for name, w in expert.items():
        delta = (w.double() - base[name].double()).abs()
        if delta.dim() == 1:
            row_mavs.append(delta.mean().reshape(1))
        elif delta.dim() == 2:
            row_mavs.append(delta.mean(dim=1))
    return float(torch.cat(row_mavs).mean())


def inverse_weights(magnitudes: Sequence[float]) -> list[float]:
    inverse = [1.0 / m for m in magnitudes]
    return [x / sum(inverse) for x in inverse]


# -- TIES (docs/concepts/methods.md) -----------------------------------------------------
def kept_count(density: float, numel: int) -> int:
    """How many entries of a delta TIES keeps: mergekit's max(1, int(density·n))."""
    return numel if density >= 1.0 else max(1, int(density * numel))


def top_k_mask(magnitude: torch.Tensor, density: float) -> torch.Tensor:
    """Exactly k = ⌊density·n⌋ largest entries (the float product, at least one; all at density
    1), mergekit's count; among equal values the first in flat order."""
    flat = magnitude.flatten()
    k = kept_count(density, flat.numel())
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order] = True
    return keep.view(magnitude.shape)


def ties(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    density: float | Sequence[float],
    lambda_: float,
    normalize: bool,
) -> torch.Tensor:
    """TIES for one tensor, computed in float32 (not rounded); `density` one for every expert
    or one each."""
    b = base.float()
    densities = [density] * len(experts) if isinstance(density, float | int) else density
    trimmed = []
    for expert, kept in zip(experts, densities, strict=True):
        delta = expert.float() - b
        trimmed.append(torch.where(top_k_mask(delta.abs(), kept), delta, 0.0))
    weighted = [w * d for w, d in zip(weights, trimmed, strict=True)]
    total = torch.zeros_like(b)
    for x in weighted:
        total = total + x
    elected = torch.where(total >= 0, 1.0, -1.0)
    merged = torch.zeros_like(b)
    divisor = torch.zeros_like(b)
    for w, x in zip(weights, weighted, strict=True):
        agrees = torch.sign(x) == elected
        merged = merged + torch.where(agrees, x, torch.zeros_like(x))
        divisor = divisor + agrees.float() * w
    if normalize:
        merged = merged / torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    return b + lambda_ * merged


# -- nuslerp and model_stock (docs/concepts/methods.md) ---------------------------------------
def vectors(x: torch.Tensor, along: str) -> torch.Tensor:
    """The tensor as a matrix whose rows are the vectors angles are measured between: the
    whole tensor ("tensor"), each row along the last dim ("rows") or each column along the
    first ("columns"). A 0-D or 1-D tensor is one vector."""
    if along == "tensor" or x.dim() < 2:
        return x.reshape(1, -1)
    if along == "rows":
        return x.reshape(-1, x.shape[-1])
    return x.reshape(x.shape[0], -1).t()


def from_vectors(m: torch.Tensor, shape: torch.Size, along: str) -> torch.Tensor:
    if along == "columns" and len(shape) >= 2:
        return m.t().reshape(shape)
    return m.reshape(shape)


def nuslerp(
    t: float, a: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None, along: str
) -> torch.Tensor:
    """mergekit's nuslerp in float64, vector by vector: of a and b, or of a − base and
    b − base added to base."""
    x, y = a.double(), b.double()
    if base is not None:
        x, y = x - base.double(), y - base.double()
    rows = []
    for u, v in zip(vectors(x, along), vectors(y, along), strict=True):
        cos = float(torch.dot(u / max(float(u.norm()), 1e-7), v / max(float(v.norm()), 1e-7)))
        cos = min(1.0, max(-1.0, cos))
        if 1 - cos * cos <= 1e-16:
            rows.append((1 - t) * u + t * v)
        else:
            theta = math.acos(cos)
            rows.append((math.sin((1 - t) * theta) * u + math.sin(t * theta) * v) / math.sin(theta))
    out = from_vectors(torch.stack(rows), a.shape, along)
    return out + base.double() if base is not None else out


def model_stock(base: torch.Tensor, models: Sequence[torch.Tensor], along: str) -> torch.Tensor:
    """mergekit's model_stock in float64, vector by vector: t·mean(models) + (1 − t)·base, with
    t = N·cos / (1 + (N − 1)·cos) from the mean pairwise cos of the task vectors."""
    n = len(models)
    w0 = vectors(base.double(), along)
    ws = [vectors(m.double(), along) for m in models]
    rows = []
    for k in range(w0.shape[0]):
        deltas = [w[k] - w0[k] for w in ws]
        cosines = []
        for i in range(n):
            for j in range(i + 1, n):
                product = max(float(deltas[i].norm() * deltas[j].norm()), 1e-6)
                cosines.append(
                    min(1.0, max(-1.0, float(torch.dot(deltas[i], deltas[j])) / product))
                )
        cos = sum(cosines) / len(cosines)
        denominator = 1 + (n - 1) * cos
        t = 0.0 if abs(denominator) < 1e-6 else n * cos / denominator
        rows.append(t * sum(w[k] for w in ws) / n + (1 - t) * w0[k])
    return from_vectors(torch.stack(rows), base.shape, along)


# -- comparisons ------------------------------------------------------------------------------
def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (float32 tensor), floored at the smallest normal's."""
    x = x.float().abs()
    tiny = torch.finfo(dtype).tiny
    _, exponent = torch.frexp(torch.clamp(x, min=tiny))
    return torch.ldexp(torch.ones_like(x), exponent - 1 - MANTISSA_BITS[dtype])


def accumulation_slack(
    coefficients: Sequence[float], tensors: Sequence[torch.Tensor]
) -> torch.Tensor:
    """A float32 rounding-error bound for Σ c_i·T_i summed in any order: n·eps·Σ|c_i·T_i|.

    Only matters where the sum cancels to (nearly) zero, where one output ulp is tiny.
    """
    magnitude = sum(abs(c) * t.float().abs() for c, t in zip(coefficients, tensors, strict=True))
    return len(tensors) * torch.finfo(torch.float32).eps * torch.as_tensor(magnitude)


def assert_within_ulps(
    actual: torch.Tensor,
    expected: torch.Tensor,
    ulps: float = 1.0,
    name: str = "",
    slack: torch.Tensor | float = 0.0,
) -> None:
    """|actual − expected| ≤ ulps·ulp(dtype) at the larger of the two (+ float32 `slack`)."""
    dtype = actual.dtype
    assert actual.shape == expected.shape, name
    a, e = actual.float(), expected.float()
    bound = ulps * ulp(torch.maximum(a.abs(), e.abs()), dtype) + slack
    excess = (a - e).abs() - bound
    worst = int(excess.argmax()) if excess.numel() else 0
    assert bool((excess <= 0).all()), (
        f"{name}: {int((excess > 0).sum())} elements beyond {ulps} ulp; e.g. "
        f"actual {a.flatten()[worst].item()!r} expected {e.flatten()[worst].item()!r}"
    )


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    if not torch.equal(actual, expected):
        diff = (actual.float() - expected.float()).abs()
        raise AssertionError(
            f"{name}: {int((diff > 0).sum())} of {diff.numel()} elements differ "
            f"(max {float(diff.max())})"
        )
