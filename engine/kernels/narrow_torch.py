"""mergekit's arithmetic in bfloat16 and float16 (its config's `dtype`, or the checkpoints' own
without one) for task arithmetic, TIES and the sparsifying methods, in torch, chunk by chunk.

mergekit 0.1.5's generalized task arithmetic computes in that dtype: each delta rounded to it,
weighted by weights rounded to it, summed over the models (torch adds a bf16 or fp16 sum in
float32 and rounds it once), divided, scaled and added to the base, each step rounded. Each step
here is the same torch operation on tensors of that dtype, so the bytes are mergekit's.

Its selections by |δ| (TIES's largest, breadcrumbs' band) come from torch's sort of the whole
tensor, which is not stable: which of equal |δ| at a cut it keeps follows from the sort's
arithmetic on every entry. bf16 deltas tie often, so a tensor of up to SORTED_ELEMENTS entries
is sorted whole here too, by the same call (`sorted_mask`: its bytes are then mergekit's); a
larger one keeps the first of equal |δ| in flat order (top_k.py, sparse_torch.py), which differs
from mergekit's only at those ties. The sparsifying methods' random drops are
sparse_torch.py's seeded rules (mergekit's are unseeded); their L1 norms (`rescale`) are torch's
own sums of the whole tensor where it fits in memory, on the threads mergekit's run on (a sum's
order follows their count), else exact sums rounded to the working dtype, which differ from
mergekit's float32 sums in the last bit at times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine.kernels.exact_sums import FLOAT32, rounded_sum
from engine.kernels.input_rows import InputRows
from engine.kernels.parallel import MIN_SPLIT, parallel
from engine.kernels.sparse_masks import breadcrumb_ranks
from engine.kernels.sparse_torch import SparseMerge
from engine.kernels.top_k import TopK, keep_mask
from engine.plan.model import TensorPlan, TiesSettings

# (source, start, count) -> that input's elements in the narrow dtype
Read = Callable[[int, int, int], torch.Tensor]
# per term: top_k's threshold and tie quota, a whole-tensor mask (sorted_mask), or None (kept)
Selection = TopK | torch.Tensor | None

NARROW = (torch.bfloat16, torch.float16)
# A tensor of up to this many entries is selected from by sorting it whole, as mergekit does:
# norms, biases and small models' weights. Sorting is most of what mergekit's TIES costs
# (sorting every layer weight of the 1.7B benchmark pair more than doubled Layerswap's bf16
# TIES time); top_k.py's selection differs from it only in which of equal |δ| at a cut are kept.
SORTED_ELEMENTS = 1 << 16
RESCALE_EPS = 1e-7  # mergekit's: a norm below it (in its working dtype) leaves δ unscaled


def sorted_mask(
    magnitudes: Iterable[torch.Tensor], numel: int, ranks: tuple[int, int], *, descending: bool
) -> torch.Tensor:
    """Which entries torch's sort of the whole |δ| (float32, given chunk by chunk in order)
    puts at positions [ranks[0], ranks[1]): mergekit's selection, equal |δ| at a cut taken as
    that sort takes them (it is not stable). A bool tensor of `numel` entries, on the CPU."""
    whole = torch.empty(numel, dtype=torch.float32)
    at = 0
    for chunk in magnitudes:
        whole[at : at + chunk.numel()] = chunk.reshape(-1)
        at += chunk.numel()
    order = torch.sort(whole, descending=descending).indices
    del whole
    keep = torch.zeros(numel, dtype=torch.bool)
    keep[order[ranks[0] : ranks[1]]] = True
    return keep


def coefficients(tensor: TensorPlan, like: torch.Tensor) -> torch.Tensor:
    """The terms' weights as a column in `like`'s dtype (rounded to it, as mergekit's)."""
    column = [[term.coefficient] for term in tensor.terms]
    return torch.tensor(column, dtype=like.dtype, device=like.device)


def combine(
    base: torch.Tensor, deltas: torch.Tensor, weights: torch.Tensor, *, consensus: bool,
    normalize: bool, lambda_: float,
) -> torch.Tensor:  # fmt: skip
    """base + λ·Σ wᵢ·δᵢ [over the entries agreeing with the elected sign] [÷ Σ wᵢ], every
    step in the dtype of `deltas` (one row per model; `weights`, one column)."""
    deltas.mul_(weights)
    if consensus:  # the sign of the weighted sum, 0 counting as +; a zero δ agrees with none
        elected = (deltas.sum(dim=0) >= 0).to(deltas.dtype) * 2 - 1
        agree = deltas.sign() == elected
        mixed = (deltas * agree).sum(dim=0)
        divisor = (weights * agree).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        mixed = deltas.sum(dim=0)
        divisor = weights.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        mixed /= divisor
    if lambda_ != 1:
        mixed *= lambda_
    return base + mixed


class NarrowTaskVectors:
    """One task-arithmetic or TIES tensor (TIES: `selections` trim its deltas), chunk by chunk
    in order (tied entries are kept while each term's quota lasts)."""

    def __init__(
        self, read: Read, tensor: TensorPlan, settings: TiesSettings, selections: list[Selection]
    ) -> None:
        self.read, self.tensor, self.settings = read, tensor, settings
        self.selections = selections
        self.ties_left = [top.ties if isinstance(top, TopK) else 0 for top in selections]
        # compiled_chunk's inputs, where every one is stored in the arithmetic's dtype: read
        # as they are, side by side into one kept buffer (reading them one by one through
        # `read`, a fresh tensor each, took the 1.7B pair's merge a quarter of its time)
        self.stored: tuple[InputRows, torch.dtype] | None = None
        self._weights: tuple[Any, float] | None = None  # the tensor's: _constants()

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """In torch (any device): combine()'s steps on the trimmed deltas."""
        base = self.read(self.settings.base, start, count)
        deltas = torch.empty((len(self.tensor.terms), count), dtype=base.dtype, device=base.device)
        for i, (term, top) in enumerate(zip(self.tensor.terms, self.selections, strict=True)):
            delta = torch.sub(self.read(term.source, start, count), base, out=deltas[i])
            if isinstance(top, TopK):
                keep, self.ties_left[i] = keep_mask(delta.abs().float(), top, self.ties_left[i])
                delta.mul_(keep.to(delta.dtype))  # mergekit's mask: a dropped −δ is −0
            elif top is not None:
                delta.mul_(top[start : start + count].to(delta.device, delta.dtype))
        return combine(
            base, deltas, coefficients(self.tensor, base), consensus=self.tensor.op == "ties",
            normalize=self.settings.normalize, lambda_=self.settings.scale(self.tensor),
        )  # fmt: skip

    def compiled_chunk(self, start: int, count: int) -> torch.Tensor:
        """The same bits from the compiled kernel (narrow.py), on the CPU."""
        # numba and numpy: the compiled combination, loaded by the first such tensor
        import numpy as np

        from engine.kernels import narrow

        base, terms, dtype = self._inputs(start, count)
        column, divisor = self._constants(dtype)
        out = np.empty(count, np.uint16)
        shared = (dtype == torch.float16, self.settings.normalize)
        lambda_ = self.settings.scale(self.tensor)
        scaled = (lambda_ != 1, lambda_, out)
        if self.tensor.op == "ties":  # one thread while a tie quota lasts: flat order
            quotas = np.array(self.ties_left, np.int64)
            split = count + 1 if quotas.any() else MIN_SPLIT
            parallel(narrow.ties, count, base, terms, column, *self._trims(), quotas,
                     self._masks(start, count), *shared, *scaled, minimum=split)  # fmt: skip
            self.ties_left = [int(left) for left in quotas]
        else:
            parallel(narrow.task_arithmetic, count, base, terms, column, *shared, divisor,
                     *scaled)  # fmt: skip
        return torch.from_numpy(out).view(dtype)

    def _inputs(self, start: int, count: int) -> tuple[Any, Any, torch.dtype]:
        """The base's and each term's elements [start, start + count) as 16-bit patterns (the
        terms one row each), and the arithmetic's dtype."""
        import numpy as np  # numpy: as compiled_chunk, which alone calls this

        if self.stored is not None:
            rows, dtype = self.stored
            sources = [self.settings.base, *(term.source for term in self.tensor.terms)]
            read = rows.read(self.tensor, sources, start, count)
            return read[0], read[1:], dtype
        base = self.read(self.settings.base, start, count)
        terms = np.empty((len(self.tensor.terms), count), np.uint16)
        for i, term in enumerate(self.tensor.terms):
            terms[i] = _bits(self.read(term.source, start, count))
        return _bits(base), terms, base.dtype

    def _constants(self, dtype: torch.dtype) -> tuple[Any, float]:
        """The weights rounded to `dtype` (as mergekit's), as float32 for the kernels, and the
        divisor task arithmetic normalizes by (as combine() makes it): the same for each chunk."""
        if self._weights is None:
            weights = coefficients(self.tensor, torch.empty(0, dtype=dtype))
            divisor = weights.sum(dim=0)
            divisor[divisor.abs() < 1e-8] = 1
            self._weights = (weights.float().numpy().reshape(-1), float(divisor))
        return self._weights

    def _trims(self) -> tuple[Any, Any]:
        """Per term: how it is trimmed (narrow.py's modes) and its threshold."""
        import numpy as np  # numpy: as compiled_chunk, which alone calls this

        from engine.kernels import narrow  # numba: as compiled_chunk

        modes = np.zeros(len(self.selections), np.int8)
        thresholds = np.zeros(len(self.selections), np.float32)
        for i, top in enumerate(self.selections):
            if isinstance(top, TopK):
                modes[i], thresholds[i] = narrow.THRESHOLD, top.threshold
            elif top is not None:
                modes[i] = narrow.MASK
        return modes, thresholds

    def _masks(self, start: int, count: int) -> Any:
        """The whole-tensor masks' elements [start, start + count), one row per term."""
        import numpy as np  # numpy: as compiled_chunk, which alone calls this

        masks = np.ones((len(self.selections), count), np.bool_)
        for i, top in enumerate(self.selections):
            if isinstance(top, torch.Tensor):
                masks[i] = top[start : start + count].numpy()
        return masks


def _bits(x: torch.Tensor) -> Any:
    """A CPU bf16 or fp16 tensor's 16-bit patterns, as a numpy uint16 array (no copy)."""
    return x.contiguous().view(torch.int16).numpy().view("uint16")


class NarrowSparseMerge(SparseMerge):
    """SparseMerge's masks (read in the narrow dtype: deltas rounded to it), thinned, rescaled
    and combined in mergekit's narrow arithmetic. Its random drops (DARE, DELLA) compute in
    float32 for fp16 on the CPU, as torch's bernoulli has no fp16 kernel there."""

    factors: list[torch.Tensor | None]
    # A tensor of up to `sorted_elements` entries is sorted whole (breadcrumbs), one of up to
    # `in_memory` has its norms summed whole, by torch's own calls on `threads` threads (the
    # process's default, as mergekit runs with: a sum's order follows the thread count).
    sorted_elements = 0
    in_memory = 0
    threads = 0
    sorted_masks: list[torch.Tensor | None] | None = None  # their bands, when sorted whole

    def _sort_bands(self) -> None:
        """Breadcrumbs' bands by torch's sort of the whole |δ|, as mergekit's."""
        self.sorted_masks = [None] * len(self.thinned)
        for i, thin in enumerate(self.thinned):
            if thin:
                ranks = breadcrumb_ranks(
                    self.numel, self.thinning.densities[i], self.thinning.gammas[i]
                )
                deltas = (delta.abs().float() for _, delta in self._deltas(i))
                self.sorted_masks[i] = sorted_mask(deltas, self.numel, ranks, descending=False)

    def _sort_tops(self) -> None:
        """TIES's k largest |δ| by torch's sort of the whole |δ|, descending, as mergekit's."""
        self.sorted_masks = [None] * len(self.thinned)
        for i, thin in enumerate(self.thinned):
            if thin:
                k = max(1, int(self.thinning.densities[i] * self.numel))
                deltas = (delta.abs().float() for _, delta in self._deltas(i))
                self.sorted_masks[i] = sorted_mask(deltas, self.numel, (0, k), descending=True)

    def _cut(self, i: int, delta: torch.Tensor, first: int) -> torch.Tensor:
        if self.sorted_masks is None:
            return super()._cut(i, delta, first)
        return self._sorted(i, delta, first)

    def _top(self, i: int, delta: torch.Tensor, first: int) -> torch.Tensor:
        if self.sorted_masks is None:
            return super()._top(i, delta, first)
        return self._sorted(i, delta, first)

    def _sorted(self, i: int, delta: torch.Tensor, first: int) -> torch.Tensor:
        assert self.sorted_masks is not None
        mask = self.sorted_masks[i]
        assert mask is not None
        return mask[first : first + delta.numel()].to(delta.device)

    def chunk(self, start: int, count: int) -> torch.Tensor:
        if self.scales is None:
            self._prepare()
        base = self.read(self.settings.base, start, count)
        masks = self._masks(start, count)
        deltas = torch.empty((len(self.tensor.terms), count), dtype=base.dtype, device=base.device)
        for i, term in enumerate(self.tensor.terms):
            delta = torch.sub(self.read(term.source, start, count), base, out=deltas[i])
            mask = masks[i]
            if mask is not None:
                deltas[i] = self._thinned(i, delta, mask)
        return combine(
            base, deltas, coefficients(self.tensor, base), consensus=self.settings.consensus,
            normalize=self.settings.normalize, lambda_=self.thinning.lambda_,
        )  # fmt: skip

    def _work(self, dtype: torch.dtype) -> torch.dtype:
        random = self.settings.dropping in ("random", "magprune")
        return torch.float32 if random and dtype == torch.float16 else dtype

    def _thinned(self, i: int, delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        work = self._work(delta.dtype)
        masked = delta.to(work) * mask.to(work)
        factor = self.factors[i]
        return (masked if factor is None else masked * factor).to(delta.dtype)

    def _prepare(self) -> None:
        small = self.numel <= self.sorted_elements
        if small and self.settings.dropping == "outliers":
            self._sort_bands()
            self.scales = [1.0] * len(self.thinned)
        elif small and self.settings.dropping == "magnitude":
            self._sort_tops()
            self.scales = [1.0] * len(self.thinned)
        else:
            super()._prepare()  # cuts or tops; float scales, unused here, left at 1
        rescaled = [self.settings.rescale and thin for thin in self.thinned]
        self.factors = [self._factor(i) if scaled else None for i, scaled in enumerate(rescaled)]

    def _scales(self) -> list[float]:
        return [1.0] * len(self.thinned)

    def _factor(self, i: int) -> torch.Tensor | None:
        """‖δ‖₁ / ‖kept‖₁ in the working dtype; None where either is below RESCALE_EPS there
        (mergekit leaves δ unscaled)."""
        work = self._work(self.read(self.settings.base, 0, 1).dtype)
        before, after = self._whole_norms(i, work) if self.numel <= self.in_memory else (
            self._exact_norms(i, work))  # fmt: skip
        if bool(before < RESCALE_EPS) or bool(after < RESCALE_EPS):
            return None
        return before / after

    def _whole_norms(self, i: int, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The norms as mergekit sums them: torch's sum of the whole tensor."""
        whole = torch.cat([delta.to(work) for _, delta in self._deltas(i)])
        mask = self._mask(i, 0, self.numel)
        assert mask is not None
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads or previous)
        try:
            return whole.abs().sum(), (whole * mask.to(work)).abs().sum()
        finally:
            torch.set_num_threads(previous)

    def _exact_norms(self, i: int, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact sums rounded to the working dtype (a larger tensor, summed in chunks)."""
        full, kept, _ = self._norm_bins(i)
        norms = [self._rounded(bins, work) for bins in (full, kept)]
        before, after = (torch.tensor(n, dtype=torch.float64).to(work) for n in norms)
        return before, after

    @staticmethod
    def _rounded(bins: list[int], work: torch.dtype) -> float:
        if work == torch.float32:
            return rounded_sum(bins, FLOAT32)
        return rounded_sum(bins, FLOAT32, to_float64=True)  # then to the narrow dtype
