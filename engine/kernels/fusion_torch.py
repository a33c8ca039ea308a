"""arcee_fusion in torch: the model's entries whose change from the base matters most, on the
base.

Per tensor, with rows along its last dimension (a vector is one row): the importance of an
entry is |model − base| times its row's KL(p ‖ q), p and q the softmax of the model's and the
base's row, each + 1e-8; the entries whose importance reaches median + 1.5·(q₃ − q₁) of the
tensor's importances take the model's value, the others the base's:
out = base + (model − base)·[importance ≥ threshold].

Two passes over the inputs, a block of whole rows at a time: the first keeps each row's KL and
the importances the quantiles are taken of, the second makes the output. The quantiles are
order statistics of the tensor's importances (the one a sort puts at int(q·(n − 1))), as
mergekit 0.1.5 finds them, with its float32 steps throughout, so the bytes equal its output.
Of a tensor of more than a million entries mergekit sorts a random sample of a million (drawn
anew each run); Layerswap takes a fixed sample of a million entries spread over the tensor, so
its threshold is the same each run and near mergekit's, not equal to it. Held in memory: a KL
per row, the sample (4 MB) and its positions, and one block of rows of each input.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.interpolation_torch import Read
from engine.kernels.torch_threads import using_threads
from engine.plan.model import TensorPlan

SAMPLE = 1_000_000  # quantiles of a larger tensor come from a sample of this many entries
QUANTILES = (0.25, 0.5, 0.75)
SPREAD = 1.5  # the threshold: median + SPREAD·(q₃ − q₁)
EPS = 1e-8  # added to each softmax before the KL
_STRIDE = 0x9E3779B1  # sample position i·_STRIDE mod n: spread over the rows and columns


class Fusion:
    """One `arcee_fusion` tensor: terms (base, 1), (model, 1)."""

    def __init__(self, read: Read, tensor: TensorPlan, *, chunk: int) -> None:
        self.read = read
        self.base, self.model = tensor.terms[0].source, tensor.terms[1].source
        self.numel = math.prod(tensor.shape)
        self.length = tensor.shape[-1] if tensor.shape and self.numel else 1
        self.rows = self.numel // self.length if self.numel else 0
        self.block = max(1, chunk // self.length)  # rows read at once (a longer row alone)
        self.threads = 0  # torch's for the KLs and the sort, as sphere_torch.Spherical's
        self._kl: torch.Tensor | None = None  # per row
        self._threshold: torch.Tensor | None = None

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the output."""
        with using_threads(self.threads):  # the rest is per entry: any count gives its bits
            if self._threshold is None:
                self._prepare()
            assert self._kl is not None and self._threshold is not None
            base = self.read(self.base, start, count)
            change = self.read(self.model, start, count) - base
            first, last = start // self.length, (start + count - 1) // self.length
            kl = self._kl[first : last + 1].repeat_interleave(self.length)
            offset = start - first * self.length
            importance = change.abs() * kl[offset : offset + count]
            # a float32 mask, as mergekit's: a narrow dtype's sum is then taken in float32
            return base + change * (importance >= self._threshold).float()

    def _prepare(self) -> None:
        """Each row's KL, and the threshold from the quantiles of the importances, each written
        into a buffer made at the first block (not gathered per block and concatenated)."""
        positions = _sample_positions(self.numel)
        kl_rows = values = None
        filled = 0
        for first in range(0, self.rows, self.block):
            rows = min(self.block, self.rows - first)
            lo, hi = first * self.length, (first + rows) * self.length
            model = self.read(self.model, lo, hi - lo).view(rows, self.length)
            base = self.read(self.base, lo, hi - lo).view(rows, self.length)
            kl = _kl(model, base)
            if kl_rows is None or values is None:
                kl_rows = kl.new_empty(self.rows)
                values = kl.new_empty(self.numel if positions is None else positions.numel())
            kl_rows[first : first + rows] = kl.view(-1)
            if positions is None:
                found = ((model - base).abs() * kl).view(-1)
            else:  # the importances of the sampled entries alone: each is elementwise
                at = positions[_between(positions, lo, hi)].to(model.device) - lo
                change = model.view(-1)[at] - base.view(-1)[at]
                found = change.abs() * kl.view(-1)[at // self.length]
            values[filled : filled + found.numel()] = found
            filled += found.numel()
        assert kl_rows is not None and values is not None  # a tensor of no rows has no chunks
        self._kl = kl_rows
        self._threshold = _threshold(values)


def _kl(model: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) of each row of a block, p and q the softmax of the model's and the base's row
    (+ EPS each), as a column."""
    p = F.softmax(model, dim=-1) + EPS
    q = F.softmax(base, dim=-1) + EPS
    return torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)


@functools.lru_cache(maxsize=8)  # a model's tensors come in a few sizes; each sort is ~0.2 s
def _sample_positions(numel: int) -> torch.Tensor | None:
    """Sorted flat positions of the sampled entries; None: every entry counts."""
    if numel <= SAMPLE:
        return None
    positions = torch.arange(SAMPLE, dtype=torch.int64) * _STRIDE % numel
    return torch.sort(positions).values


def _between(positions: torch.Tensor, lo: int, hi: int) -> slice:
    """The part of sorted `positions` in [lo, hi)."""
    return slice(int(torch.searchsorted(positions, lo)), int(torch.searchsorted(positions, hi)))


def _threshold(values: torch.Tensor) -> torch.Tensor:
    """median + 1.5·(q₃ − q₁) of `values`, each quantile the order statistic at
    int(q·(n − 1)) (float32 product, as mergekit's): the value a sort puts there, found by a
    partition of the values widened exactly (about 4x faster than torch's sort)."""
    flat = values.reshape(-1)
    at = (torch.tensor(QUANTILES) * (flat.numel() - 1)).long().tolist()
    wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
    picked = np.partition(flat.cpu().to(wide).numpy(), at)[at]
    first, median, third = torch.from_numpy(picked).to(flat.dtype).to(flat.device).unbind()
    return median + SPREAD * (third - first)
