"""The sparsifying methods (DARE, breadcrumbs, DELLA; TIES with rescale) in torch: the CUDA
path, float64 inputs, and the reference the compiled CPU kernels (sparse.py) equal bit for bit.

Every step is the same float (float64 for F64 inputs) or integer operation as there, in the
same order, so the bytes do not depend on the device: Philox bits from integer arithmetic that
never overflows, masks from exact order statistics (radix selection over |δ|'s bit patterns,
16 bits a pass) or a stable sort of each row's |δ| bits, L1 norms summed exactly
(exact_sums.py), then element-wise float arithmetic, one torch op per step (no fused ops).
Only whole-tensor statistics are kept (cuts, scales); each chunk's masks are made again when
it is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from engine.kernels.exact_sums import FLOAT32, FLOAT64, Format, rescale_factor, rounded_sum
from engine.kernels.random_bits import KEY_STEPS, MULTIPLIERS, ROUNDS, SCALE, stream_key
from engine.kernels.sparse_masks import Cut, breadcrumb_ranks
from engine.plan.model import SparsifySettings, TensorPlan

# (source, start, count) -> that input's elements, widened to the arithmetic dtype
Read = Callable[[int, int, int], torch.Tensor]
_LOW = 0xFFFFFFFF
_DIGIT = 16  # bits per radix-selection pass


def philox_bits(key: tuple[int, int], start: int, count: int, device: torch.device) -> torch.Tensor:
    """random_bits.fill_bits in torch: the 32-bit values (as int64) of elements
    [start, start + count) of the stream under `key`."""
    first, last = start >> 2, (start + count - 1) >> 2
    blocks = torch.arange(first, last + 1, dtype=torch.int64, device=device)
    c0, c1 = blocks & _LOW, blocks >> 32
    c2, c3 = torch.zeros_like(blocks), torch.zeros_like(blocks)
    k0, k1 = key
    for _ in range(ROUNDS):
        high0, low0 = _mulhilo(MULTIPLIERS[0], c0)
        high1, low1 = _mulhilo(MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = high1 ^ c1 ^ k0, low1, high0 ^ c3 ^ k1, low0
        k0, k1 = (k0 + KEY_STEPS[0]) & _LOW, (k1 + KEY_STEPS[1]) & _LOW
    lanes = torch.stack([c0, c1, c2, c3], dim=1).view(-1)
    return lanes[start - 4 * first : start - 4 * first + count]


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of multiplier·x (both < 2³²) from two products of < 2⁴⁸, so
    that nothing overflows int64."""
    low_part = x * (multiplier & 0xFFFF)
    high_part = x * (multiplier >> 16)
    low_sum = low_part + ((high_part & 0xFFFF) << 16)
    return ((high_part >> 16) + (low_sum >> 32)) & _LOW, low_sum & _LOW


def _bits(x: torch.Tensor) -> torch.Tensor:
    """|x|'s bit patterns as int64: ordered like the values (NaN above infinity). bf16 and
    fp16 values (mergekit's narrow arithmetic) are widened to float32 first, exactly."""
    magnitude = x.abs()
    if magnitude.dtype == torch.float64:
        return magnitude.view(torch.int64)
    return magnitude.float().view(torch.int32).to(torch.int64)


def _format(x: torch.Tensor) -> Format:
    return FLOAT64 if x.dtype == torch.float64 else FLOAT32


def exact_bins(x: torch.Tensor) -> list[int]:
    """exact_sums' bins of |x| (float32 or float64), added on x's device."""
    fmt = _format(x)
    bits = _bits(x)
    exponent = bits >> fmt.significand_bits
    fraction = bits & ((1 << fmt.significand_bits) - 1)
    top = (1 << fmt.exponent_bits) - 1  # infinity and NaN
    significand = fraction | ((exponent != 0).to(torch.int64) << fmt.significand_bits)
    special = exponent == top
    index = torch.where(special, top + (fraction != 0).to(torch.int64), exponent)
    weight = torch.where(special, 1, significand)
    # float64 weights add integers exactly below 2⁵³: a significand (< 2⁵³) in halves below
    # 2²⁷, 2²⁶ elements at a time; each half's totals in int64, joined as Python integers
    high = torch.zeros(fmt.bins, dtype=torch.int64, device=x.device)
    low = torch.zeros_like(high)
    step, mask = 1 << 26, (1 << 27) - 1
    for at in range(0, x.numel(), step):
        part, where = weight.view(-1)[at : at + step], index.view(-1)[at : at + step]
        for total, half in ((high, part >> 27), (low, part & mask)):
            counted = torch.bincount(where, weights=half.to(torch.float64), minlength=fmt.bins)
            total += counted.to(torch.int64)
    return [(int(h) << 27) + int(lo) for h, lo in zip(high.tolist(), low.tolist(), strict=True)]


class SparseMerge:
    """One `sparsify` tensor: its whole-tensor statistics first, then output chunks."""

    def __init__(
        self, read: Read, tensor: TensorPlan, settings: SparsifySettings, step: int
    ) -> None:
        assert tensor.thinning is not None
        self.read, self.tensor, self.settings = read, tensor, settings
        self.thinning = tensor.thinning
        self.numel = math.prod(tensor.shape)
        self.thinned = [d < 1.0 for d in self.thinning.densities]
        # DELLA ranks along dim 1 (a vector: along itself): a slab is one index of dim 0
        shape = tensor.shape if len(tensor.shape) > 1 else (1, *tensor.shape)
        self.width, self.rest = shape[1], math.prod(shape[2:])
        self.slab = self.width * self.rest if settings.dropping == "magprune" else 1
        self.step = max(1, step // self.slab) * self.slab
        self.cuts: list[tuple[Cut, Cut] | None] | None = None
        self.tops: list[Cut | None] | None = None  # TIES's k largest (_largest)
        self.scales: list[float] | None = None

    def chunk(self, start: int, count: int) -> torch.Tensor:
        if self.scales is None:
            self._prepare()
        assert self.scales is not None
        base = self.read(self.settings.base, start, count)
        masks = self._masks(start, count)
        one = torch.ones((), dtype=base.dtype, device=base.device)
        total = torch.zeros_like(base)
        weighted, weights = [], []
        for i, term in enumerate(self.tensor.terms):
            delta = self.read(term.source, start, count).sub_(base)
            mask = masks[i]
            if mask is not None:
                delta = delta.mul_(mask.to(base.dtype)).mul_(one * self.scales[i])
            weight = one * term.coefficient
            delta = delta.mul_(weight)
            total = total.add_(delta)
            weighted.append(delta)
            weights.append(weight)
        if self.settings.consensus:
            mixed, divisor = self._agreeing(total, weighted, weights)
        else:
            mixed, divisor = total, torch.zeros_like(one)
            for weight in weights:
                divisor = divisor + weight
            divisor = torch.where(divisor.abs() < one * 1e-8, one, divisor)
        if self.settings.normalize:
            mixed = mixed.div_(divisor)
        if self.thinning.lambda_ != 1.0:
            mixed = mixed.mul_(one * self.thinning.lambda_)
        return base.add_(mixed)

    @staticmethod
    def _agreeing(
        total: torch.Tensor, weighted: list[torch.Tensor], weights: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum of the weighted deltas whose sign is the sign of their total (zero counts
        as +), and the sum of their weights (0 → 1)."""
        up = total >= 0
        mixed, divisor = torch.zeros_like(total), torch.zeros_like(total)
        for delta, weight in zip(weighted, weights, strict=True):
            agree = torch.where(up, delta > 0, delta < 0).to(total.dtype)
            mixed = mixed.add_(delta * agree)
            divisor = divisor.add_(weight * agree)
        return mixed, torch.where(divisor == 0, 1, divisor)

    # -- masks ----------------------------------------------------------------------------------
    def _masks(self, start: int, count: int) -> list[torch.Tensor | None]:
        """Per term, whether each of elements [start, start + count) is kept (None: all)."""
        return [self._mask(i, start, count) for i in range(len(self.thinned))]

    def _mask(self, i: int, start: int, count: int) -> torch.Tensor | None:
        if not self.thinned[i]:
            return None
        lo = start // self.slab * self.slab  # DELLA needs whole slabs
        hi = min(self.numel, -(-(start + count) // self.slab) * self.slab)
        base = self.read(self.settings.base, lo, hi - lo)
        delta = self.read(self.tensor.terms[i].source, lo, hi - lo).sub_(base)
        mask = MASKS[self.settings.dropping](self, i, delta, lo)
        return mask[start - lo : start - lo + count]

    def _random(self, i: int, delta: torch.Tensor, first: int) -> torch.Tensor:
        threshold = math.ceil(self.thinning.densities[i] * SCALE)
        return philox_bits(self._key(i), first, delta.numel(), delta.device) < threshold

    def _cut(self, i: int, delta: torch.Tensor, first: int) -> torch.Tensor:
        assert self.cuts is not None
        cuts = self.cuts[i]
        assert cuts is not None
        bits = _bits(delta)
        index = torch.arange(first, first + delta.numel(), device=delta.device)
        low, high = cuts
        below_high = (bits < high.value) | ((bits == high.value) & (index < high.cutoff))
        below_low = (bits < low.value) | ((bits == low.value) & (index < low.cutoff))
        return below_high & ~below_low

    def _top(self, i: int, delta: torch.Tensor, first: int) -> torch.Tensor:
        assert self.tops is not None
        top = self.tops[i]
        assert top is not None
        bits = _bits(delta)
        index = torch.arange(first, first + delta.numel(), device=delta.device)
        return (bits > top.value) | ((bits == top.value) & (index < top.cutoff))

    def _magprune(self, i: int, delta: torch.Tensor, first: int) -> torch.Tensor:
        """Keep probabilities from each entry's rank by |δ| along dim 1 (equal |δ| in flat
        order: a stable sort), then Philox bits against them."""
        density, epsilon = self.thinning.densities[i], self.thinning.epsilons[i]
        slabs = delta.view(-1, self.width, self.rest)
        order = torch.sort(_bits(slabs), dim=1, stable=True).indices
        ranks = torch.empty_like(order)
        positions = torch.arange(self.width, device=delta.device).view(1, -1, 1)
        ranks.scatter_(1, order, positions.expand_as(order))
        dtype = torch.float64 if delta.dtype == torch.float64 else torch.float32
        last = torch.tensor(float(max(self.width - 1, 1)), dtype=dtype, device=delta.device)
        spread = ranks.to(dtype).div_(last).mul_(2.0).mul_(torch.tensor(epsilon, dtype=dtype))
        p = spread.add_(torch.tensor(density - epsilon, dtype=dtype)).view(-1)
        bits = philox_bits(self._key(i), first, delta.numel(), delta.device)
        return bits.to(torch.float64) < p.to(torch.float64) * SCALE

    def _key(self, i: int) -> tuple[int, int]:
        assert self.settings.seed is not None
        return stream_key(self.settings.seed, self.tensor.name, i)

    # -- whole-tensor statistics ------------------------------------------------------------------
    def _spans(self) -> Iterator[tuple[int, int]]:
        for start in range(0, self.numel, self.step):
            yield start, min(self.step, self.numel - start)

    def _prepare(self) -> None:
        if self.settings.dropping == "outliers":
            self.cuts = [self._cuts(i) if thin else None for i, thin in enumerate(self.thinned)]
        if self.settings.dropping == "magnitude":
            self.tops = [self._largest(i) if thin else None for i, thin in enumerate(self.thinned)]
        self.scales = [1.0] * len(self.thinned)
        if self.settings.rescale and any(self.thinned):
            self.scales = self._scales()

    def _deltas(self, i: int) -> Iterator[tuple[int, torch.Tensor]]:
        source = self.tensor.terms[i].source
        for start, count in self._spans():
            base = self.read(self.settings.base, start, count)
            yield start, self.read(source, start, count).sub_(base)

    def _scales(self) -> list[float]:
        """Per term: ‖δ‖₁ / ‖kept‖₁, each norm summed exactly (1 where nothing is dropped)."""
        scales = []
        for i, thin in enumerate(self.thinned):
            if not thin:
                scales.append(1.0)
                continue
            full, kept, fmt = self._norm_bins(i)
            scales.append(rescale_factor(rounded_sum(full, fmt), rounded_sum(kept, fmt), fmt))
        return scales

    def _norm_bins(self, i: int) -> tuple[list[int], list[int], Format]:
        """exact_sums' bins of term i's |δ| and of its kept |δ|, and their format."""
        full: list[int] | None = None
        kept: list[int] | None = None
        fmt = FLOAT32
        for start, delta in self._deltas(i):
            fmt = _format(delta)
            mask = self._mask(i, start, delta.numel())
            assert mask is not None
            full = _added(full, exact_bins(delta))
            kept = _added(kept, exact_bins(delta * mask.to(delta.dtype)))
        assert full is not None and kept is not None
        return full, kept, fmt

    def _cuts(self, i: int) -> tuple[Cut, Cut]:
        low, high = breadcrumb_ranks(
            self.numel, self.thinning.densities[i], self.thinning.gammas[i]
        )
        return self._smallest(i, low), self._smallest(i, high)

    def _smallest(self, i: int, m: int) -> Cut:
        """The Cut of term i's m smallest |δ| (equal ones in flat order)."""
        if m == 0:
            return Cut(0, 0)
        if m == self.numel:
            return Cut((1 << (self._width() - 1)) - 1, self.numel)  # every |δ| pattern
        value, below, _ = self._order_statistic(i, m)
        return Cut(value, self._after_tied(i, value, m - below))

    def _largest(self, i: int) -> Cut:
        """TIES's k largest |δ| of term i (TiesSettings.kept; equal ones at the cut, the first
        in flat order), as a Cut read the other way: kept are the |δ| bits above `value`, and
        those equal to it at a flat index below `cutoff`."""
        k = max(1, int(self.thinning.densities[i] * self.numel))
        value, below, equal = self._order_statistic(i, self.numel - k + 1)
        above = self.numel - below - equal
        return Cut(value, self._after_tied(i, value, k - above))

    def _width(self) -> int:
        return 64 if self.read(self.settings.base, 0, 1).dtype == torch.float64 else 32

    def _order_statistic(self, i: int, m: int) -> tuple[int, int, int]:
        """The bit pattern of term i's m-th smallest |δ| (1-based), how many |δ| lie below it
        and how many equal it, by radix selection: per pass, a histogram of the next 16 bits
        of the patterns that share the prefix found."""
        width = self._width()
        prefix, below, equal = 0, 0, 0
        for level in range(width // _DIGIT):
            shift = width - _DIGIT * (level + 1)
            counts = torch.zeros(1 << _DIGIT, dtype=torch.int64)
            for _, delta in self._deltas(i):
                bits = _bits(delta)
                if level:
                    bits = bits[(bits >> (shift + _DIGIT)) == prefix]
                digits = (bits >> shift) & ((1 << _DIGIT) - 1)
                counts += torch.bincount(digits, minlength=1 << _DIGIT).cpu()
            cumulative = counts.cumsum(0)
            digit = int(torch.searchsorted(cumulative, torch.tensor(m - below)))
            below += int(cumulative[digit - 1]) if digit else 0
            prefix, equal = (prefix << _DIGIT) | digit, int(counts[digit])
        return prefix, below, equal

    def _after_tied(self, i: int, value: int, needed: int) -> int:
        """The flat index after the `needed`-th |δ| of term i whose bits equal `value`."""
        for start, delta in self._deltas(i):
            equal = (_bits(delta) == value).to(torch.int64).cumsum(0)
            seen = int(equal[-1])
            if seen >= needed:
                return start + int(torch.searchsorted(equal, needed)) + 1
            needed -= seen
        raise AssertionError("an order statistic of |δ| was not found again")


def _added(total: list[int] | None, more: list[int]) -> list[int]:
    return more if total is None else [a + b for a, b in zip(total, more, strict=True)]


# dropping -> (merge, term, its deltas over [first, first + n), first) -> kept entries
MASKS: dict[str, Callable[[SparseMerge, int, torch.Tensor, int], torch.Tensor]] = {
    "random": lambda merge, i, delta, first: merge._random(i, delta, first),
    "outliers": lambda merge, i, delta, first: merge._cut(i, delta, first),
    "magprune": lambda merge, i, delta, first: merge._magprune(i, delta, first),
    "magnitude": lambda merge, i, delta, first: merge._top(i, delta, first),
}  # by name: a subclass's own (narrow_torch.py) is called
