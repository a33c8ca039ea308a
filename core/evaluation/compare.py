"""Is a score difference more than noise? An exact McNemar test on the documents both models
were scored on: only the documents where exactly one of them is right carry information.

MGSM has 250 documents per language: a difference of a few points is often within noise."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

ALPHA = 0.05


@dataclass(frozen=True)
class Paired:
    documents: int  # scored for both
    only_first: int  # first right, second wrong
    only_second: int
    difference: float  # accuracy(first) - accuracy(second) on those documents
    p_value: float
    significant: bool  # p_value < ALPHA

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mcnemar_exact(only_first: int, only_second: int) -> float:
    """Two-sided exact p-value: under no difference, each discordant document is a fair coin."""
    n = only_first + only_second
    if n == 0:
        return 1.0
    k = min(only_first, only_second)
    tail: float = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(first: dict[Any, bool], second: dict[Any, bool]) -> Paired | None:
    """`first` and `second` map document ids to right/wrong by one metric; None with no
    common one."""
    common = sorted(set(first) & set(second), key=str)
    if not common:
        return None
    only_first = sum(1 for d in common if first[d] and not second[d])
    only_second = sum(1 for d in common if second[d] and not first[d])
    p = mcnemar_exact(only_first, only_second)
    return Paired(
        documents=len(common),
        only_first=only_first,
        only_second=only_second,
        difference=(only_first - only_second) / len(common),
        p_value=p,
        significant=p < ALPHA,
    )
