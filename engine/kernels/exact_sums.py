"""Exact sums of non-negative floats in any order: what `rescale` needs, ‖δ‖₁ and ‖kept‖₁ of
a whole tensor, the same whatever the chunks, threads or device that add them up.

A float is a significand times a power of two fixed by its exponent, so the values are binned
by exponent and, per bin, their integer significands added (int64: a float32 significand has
24 bits, so a bin holds 2³⁹ of them; a float64's is added as two halves). The bins are then
added as Python integers and rounded once, to nearest even, to the dtype: the exact sum,
rounded. The bins of a float dtype with E exponent bits: 0 … 2ᴱ − 2 for finite values (0 also
holds the subnormals), 2ᴱ − 1 counting infinities, 2ᴱ counting NaNs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    exponent_bits: int
    significand_bits: int  # stored, without the implicit leading 1

    @property
    def bins(self) -> int:
        return (1 << self.exponent_bits) + 1

    @property
    def unit_exponent(self) -> int:
        """The smallest subnormal is 2 ** -unit_exponent."""
        return (1 << (self.exponent_bits - 1)) - 2 + self.significand_bits


FLOAT32 = Format(8, 23)
FLOAT64 = Format(11, 52)
RESCALE_EPS = 1e-7  # mergekit's: a norm below it leaves the thinned delta as it is


def rounded_sum(bins: Sequence[int], fmt: Format, *, to_float64: bool = False) -> float:
    """The sum the bins of `fmt` values hold, rounded to nearest (ties to even) in `fmt`, or
    with `to_float64` in float64 (from where a narrower dtype rounds it), as a Python float."""
    infinities, nans = bins[-2], bins[-1]
    if nans:
        return math.nan
    if infinities:
        return math.inf
    units = sum(int(total) << max(e, 1) - 1 for e, total in enumerate(bins[:-2]))
    precision = FLOAT64.significand_bits + 1 if to_float64 else fmt.significand_bits + 1
    shift = max(0, units.bit_length() - precision)
    if shift:
        kept, rest = divmod(units, 1 << shift)
        half = 1 << (shift - 1)
        kept += rest > half or (rest == half and kept & 1)
        units = kept
    exponent = shift - fmt.unit_exponent
    largest = (2 - 2.0**-fmt.significand_bits) * 2.0 ** ((1 << (fmt.exponent_bits - 1)) - 1)
    try:
        value = math.ldexp(units, exponent)
    except OverflowError:
        return math.inf
    return value if value <= largest or to_float64 else math.inf


def rescale_factor(before: float, after: float, fmt: Format) -> float:
    """mergekit's L1 rescale: ‖δ‖₁ / ‖kept‖₁ in the working dtype, or 1 (no rescale) when
    either norm is below RESCALE_EPS; NaN norms give NaN."""
    dtype = np.float32 if fmt is FLOAT32 else np.float64
    full, kept, eps = dtype(before), dtype(after), dtype(RESCALE_EPS)
    if full < eps or kept < eps:
        return 1.0
    return float(full / kept)
