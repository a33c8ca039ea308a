"""sce in torch (Select, Calculate, Erase: arXiv 2408.07990, as mergekit 0.1.5's `sce`).

Per tensor, with δᵢ = Tᵢ − base for the N models:

1. select (select_topk < 1): keep, in every δᵢ, the entries where the δᵢ vary most across the
   models: the k = int(count of nonzero variances × select_topk) largest per-entry variances
   (population variance over the N models);
2. calculate: wᵢ = mean(δᵢ²) / Σⱼ mean(δⱼ²) over the kept δ (1/N each when that sum is
   below 1e-6);
3. erase: per entry, elect the sign of Σᵢ δᵢ (zero counts as +) and keep only the δᵢ of that
   sign; out = base + Σ wᵢ·δᵢ / max(Σ wᵢ, 1e-6), both sums over the kept δᵢ.

A tensor whose inputs each fit in a chunk is read whole and merged with mergekit's own float32
operations (its torch.topk picks among equal variances at the cut), so the bytes equal its
output; the N deltas and a few temporaries of the tensor's size are held at once. A larger one
is read a chunk at a time: once to count the nonzero variances, once more to select the k
largest, once for the mean squares, once for the output. The selection is torch.topk's own
where the tensor's variances fit in memory (std_select.py: the very entries of equal variance
at the cut that torch keeps; `in_memory` entries, 6-8 bytes each), else exact but of equal
variances at the cut the first in flat order (top_k.py). The mean squares are summed in
torch's order (torch_order.py) with two or more models on the CPU, else in float64. So the
output equals mergekit's except past `in_memory` entries, where entries whose variance ties
with the cut may be kept where mergekit drops them, or the reverse, and with one model, by a
few ulps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from engine.kernels.interpolation_torch import Read
from engine.kernels.top_k import TopK, keep_mask, top_k
from engine.kernels.torch_threads import using_threads
from engine.plan.model import TensorPlan

DIVISOR_FLOOR = 1e-6  # Σ wᵢ of the agreeing deltas below this divides by this instead
UNIFORM_BELOW = 1e-6  # Σ mean(δᵢ²) below this weighs the models equally
_VARIANCE_BLOCK = 1 << 18  # entries whose variances are taken at once (float64 temporaries)


class Sce:
    """One `sce` tensor: terms (model, 1)… then (base, 1); scalars["select_topk"]."""

    def __init__(self, read: Read, tensor: TensorPlan, *, chunk: int, in_memory: int) -> None:
        self.read, self.tensor = read, tensor
        self.step, self.in_memory = chunk, in_memory
        self.shape = tensor.shape
        self.numel = math.prod(tensor.shape)
        self.sources = [term.source for term in tensor.terms]
        self.density = dict(tensor.scalars).get("select_topk", 1.0)
        self.threads = 0  # torch's for a tensor merged whole, as sphere_torch.Spherical's
        self.whole = self.numel <= chunk
        self._output: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self._top: TopK | None = None  # None: every entry kept (or self._kept says which)
        self._kept: torch.Tensor | None = None  # torch.topk's very choice, where reproduced
        self._nothing_kept = False
        self._ties_left = 0

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the output, asked in order."""
        if self.whole:
            if self._output is None:
                with using_threads(self.threads):
                    self._output = self._merge_whole().reshape(-1)
            return self._output[start : start + count]
        if self._weights is None:
            self._prepare()
        assert self._weights is not None
        base, deltas = self._deltas(start, count)
        masked = self._masked(deltas, start)
        return _erase(base, masked, self._weights.view(-1, 1))

    # -- whole ----------------------------------------------------------------------------
    def _merge_whole(self) -> torch.Tensor:
        xs = [self.read(s, 0, self.numel).view(self.shape) for s in self.sources]
        base = xs[-1]
        deltas = torch.stack([x - base for x in xs[:-1]])
        if self.density < 1:
            deltas = deltas * self._whole_mask(deltas).unsqueeze(0)
        count = deltas.shape[0]
        weights = _weights(deltas.square().reshape(count, -1).mean(dim=1))
        return _erase(base, deltas, weights.view(count, *([1] * (deltas.dim() - 1))))

    def _whole_mask(self, deltas: torch.Tensor) -> torch.Tensor:
        """1 where an entry's variance over the models is among the k largest, else 0."""
        if self.density <= 0:
            return torch.zeros_like(deltas[0])
        variance = _variance(deltas)
        k = int(torch.count_nonzero(variance) * self.density)
        mask = torch.zeros_like(variance)
        if k > 0:
            _, kept = torch.topk(variance.abs().view(-1), k=k, largest=True)
            mask.view(-1)[kept] = 1
        return mask

    # -- a chunk at a time ----------------------------------------------------------------
    def _deltas(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = [self.read(s, start, count) for s in self.sources]
        base = xs[-1]
        return base, torch.stack([x - base for x in xs[:-1]])

    def _spans(self) -> Iterator[tuple[int, int]]:
        for start in range(0, self.numel, self.step):
            yield start, min(self.step, self.numel - start)

    def _variances(self) -> Iterator[torch.Tensor]:
        """|variance| over the models of each entry, a chunk at a time, in flat order."""
        for start, count in self._spans():
            yield _variance(self._deltas(start, count)[1])

    def _prepare(self) -> None:
        """The selection's cut and the models' weights: passes over the whole tensor."""
        probe = self.read(self.sources[0], 0, 1)  # the inputs' dtype and device
        if 0 < self.density < 1:
            on_cpu = probe.device.type == "cpu"  # the held selection is numpy's
            held = self._held() if self.numel <= self.in_memory and on_cpu else None
            if held is not None:  # |variances| are never -0: a key of 0 is a zero
                nonzero = int(np.count_nonzero(held))
            else:
                nonzero = sum(int(torch.count_nonzero(v)) for v in self._variances())
            k = int(torch.tensor(nonzero) * self.density)
            if k > 0 and held is not None:
                self._kept = self._chosen(held, k)
            elif k > 0:
                self._top = top_k(self._variances, k, numel=self.numel, in_memory=self.in_memory)
            else:
                self._nothing_kept = True
        elif self.density <= 0:
            self._nothing_kept = True
        self._restart()
        self._weights = _weights(self._mean_squares(probe))
        self._restart()

    def _mean_squares(self, probe: torch.Tensor) -> torch.Tensor:
        """mean(δᵢ²) of each model's kept deltas: summed in torch's order (torch_order.py),
        so equal to mergekit's, where it is reproduced (two or more models, on the CPU), else
        in float64."""
        from engine.kernels import torch_order  # numba: loaded for tensors over a chunk

        models = len(self.sources) - 1
        if models > 1 and torch_order.exact_here(probe.dtype, probe.device):
            sums = torch_order.RowSums(models, self.numel, probe.dtype)
            step = max(torch_order.ALIGN, self.step // torch_order.ALIGN * torch_order.ALIGN)
            for start in range(0, self.numel, step):
                count = min(step, self.numel - start)
                sums.add(self._masked(self._deltas(start, count)[1], start).square())
            return sums.mean()
        squares = torch.zeros(models, dtype=torch.float64, device=probe.device)
        for start, count in self._spans():
            squares.add_(
                self._masked(self._deltas(start, count)[1], start).double().square_().sum(1)
            )
        return (squares / self.numel).to(probe.dtype)

    def _held(self) -> np.ndarray:
        """The whole tensor's |variances| as torch.topk compares them (std_select.keys)."""
        from engine.kernels import std_select  # numba: loaded for tensors over a chunk

        held: np.ndarray | None = None
        at = 0
        for variance in self._variances():
            part = std_select.keys(variance)
            if held is None:
                held = np.empty(self.numel, part.dtype)
            held[at : at + part.size] = part
            at += part.size
        assert held is not None
        return held

    def _chosen(self, held: np.ndarray, k: int) -> torch.Tensor:
        """The entries torch.topk keeps of the variances, as mergekit's selection does (of
        equal variances at the cut, the very ones): std_select.py."""
        from engine.kernels import std_select  # numba: loaded for tensors over a chunk

        return torch.from_numpy(std_select.top_k_mask(held, k))

    def _restart(self) -> None:
        """Back to the first entry: the tied entries at the cut are kept in flat order."""
        self._ties_left = self._top.ties if self._top is not None else 0

    def _masked(self, deltas: torch.Tensor, start: int) -> torch.Tensor:
        """The deltas of entries [start, …) with the entries not selected zeroed, as
        multiplying by the 0/1 mask."""
        if self._nothing_kept:
            return deltas * torch.zeros_like(deltas[0])
        if self._kept is not None:
            kept = self._kept[start : start + deltas.shape[-1]]
            return deltas * kept.to(device=deltas.device, dtype=deltas.dtype)
        if self._top is None:
            return deltas
        keep, self._ties_left = keep_mask(_variance(deltas), self._top, self._ties_left)
        return deltas * keep.to(deltas.dtype)


def _variance(deltas: torch.Tensor) -> torch.Tensor:
    """|population variance| over dim 0 of each entry, to the bit torch.var's on the CPU (as
    mergekit takes it): Welford's steps in float64 over the models in order, the result
    rounded to float32, then to the deltas' dtype. Elementwise, so an entry's bits do not
    depend on the entries beside it (nor on how the tensor is split into chunks); 3-25x faster
    than torch.var over the first dimension, which reduces across a stride. Taken a block at a
    time, so that its float64 temporaries stay small."""
    flat = deltas.reshape(deltas.shape[0], -1)
    out = torch.empty(flat.shape[1], dtype=deltas.dtype, device=deltas.device)
    for lo in range(0, flat.shape[1], _VARIANCE_BLOCK):
        out[lo : lo + _VARIANCE_BLOCK] = _welford(flat[:, lo : lo + _VARIANCE_BLOCK])
    return out.view(deltas.shape[1:]).abs_()


def _welford(deltas: torch.Tensor) -> torch.Tensor:
    wide = torch.float64
    mean = torch.zeros(deltas.shape[1:], dtype=wide, device=deltas.device)
    m2 = torch.zeros_like(mean)
    for i, x in enumerate(deltas, 1):
        x = x.to(wide)
        delta = x - mean
        mean += delta / i
        m2 += delta * (x - mean)
    rounded = torch.float64 if deltas.dtype == torch.float64 else torch.float32
    return (m2 / len(deltas)).to(rounded)


def _weights(mean_squares: torch.Tensor) -> torch.Tensor:
    """Each model's share of Σ mean(δ²); equal shares when that sum is about zero."""
    total = torch.sum(mean_squares).item()
    if abs(total) < UNIFORM_BELOW:
        return torch.ones_like(mean_squares) / mean_squares.shape[0]
    return mean_squares / total


def _erase(base: torch.Tensor, deltas: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """base + the weighted mean of the deltas that agree with the sign of their sum."""
    elected = (deltas.sum(dim=0) >= 0).to(deltas.dtype) * 2 - 1
    kept = weights * (deltas.sign() == elected)
    merged = (deltas * kept).sum(dim=0)
    return base + merged / kept.sum(dim=0).clamp(min=DIVISOR_FLOOR)
