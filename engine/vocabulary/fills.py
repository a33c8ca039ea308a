"""What an aligned vocabulary holds beyond plan.model's AlignedVocabulary: the rows `tokens`
entries give (zeros, forced rows, a named row of a source) and the padding rows
`pad_to_multiple_of` adds. Shared by alignment.py, which plans them, and rows.py, which reads
them; free of numpy, as planning is."""

from __future__ import annotations

from array import array
from typing import Protocol

from engine.plan.model import AlignedVocabulary

ZERO = -3  # fill: a row of zeros (a `tokens` entry's {kind: zero})
FOREIGN_ROW = -1  # fill_row: the fill input's own row of the token


class FilledVocabulary(AlignedVocabulary, Protocol):
    """What rows.py reads of a vocabulary plan. `rows` holds one entry per token; the tensors
    have `padding` rows more."""

    forced: array[int]  # per output token: 1 where every input reads the fill, even one with it
    fill_row: array[int]  # per output token: the row the fill input is read at, or FOREIGN_ROW
    padding: int  # rows past the tokens: each input's, the mean of its aligned token rows
    means: dict[tuple[int, str], bytes]  # (input, tensor) -> its padding row, once computed
