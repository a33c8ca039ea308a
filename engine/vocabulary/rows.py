"""An input's embedding or head rows in the output vocabulary's order, a block at a time.

What each row is comes from the plan (alignment.py): the input's own row, another input's (of
the token, or of the token a `tokens` entry names), zeros, or the mean of several; padding rows
past the tokens are the mean of all the input's token rows. The result is in the input's dtype,
so every kernel reads it as it reads any input tensor. Runs of consecutive rows are read with
one positioned read each.

Memory: for a block of R rows of width W elements, the block itself (R·W in the input's dtype,
written straight into the caller's buffer when the block is whole rows), plus, for the rows it
averages, a float32 accumulator and a few temporaries of one input's rows at a time (each
≤ R·W): bounded by the kernel's chunk, never by the vocabulary's size. A padding row is computed
once per input and tensor, from the input's token rows read MEAN_BLOCK_BYTES at a time into
four accumulators of one row each (cascade.py), and kept (one row per input and tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.io.checkpoint import Checkpoint
from engine.kernels.linear import narrow
from engine.kernels.row_cascade import RowSum
from engine.kernels.tensor_io import row_length
from engine.plan.model import MEAN
from engine.vocabulary.fills import ZERO, FilledVocabulary

Ints = npt.NDArray[np.int64]
Block = npt.NDArray[np.uint8]  # rows × row bytes
MEAN_BLOCK_BYTES = 16 << 20  # token rows read at a time to average them into a padding row
_NUMPY = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def read_aligned(
    vocabulary: FilledVocabulary, checkpoints: Sequence[Checkpoint], source: int, name: str,
    buffer: memoryview, first_byte: int,
) -> None:  # fmt: skip
    """Fill `buffer` with input `source`'s tensor `name` as the output vocabulary orders its
    rows, from byte `first_byte` of that (output-shaped) tensor."""
    info = checkpoints[source].tensors[name]
    row_bytes = row_length(info) * info.itemsize
    end_byte = first_byte + len(buffer)
    first_row, end_row = first_byte // row_bytes, -(-end_byte // row_bytes)
    out = np.frombuffer(buffer, np.uint8)
    if first_byte % row_bytes == 0 and end_byte % row_bytes == 0:  # whole rows: in place
        _fill_rows(vocabulary, checkpoints, source, name, out.reshape(-1, row_bytes), first_row)
        return
    block = np.empty((end_row - first_row, row_bytes), np.uint8)
    _fill_rows(vocabulary, checkpoints, source, name, block, first_row)
    skip = first_byte - first_row * row_bytes
    out[:] = block.reshape(-1)[skip : skip + len(buffer)]


def _fill_rows(
    vocabulary: FilledVocabulary, checkpoints: Sequence[Checkpoint], source: int, name: str,
    block: Block, first_row: int,
) -> None:  # fmt: skip
    """Rows first_row.. of input `source`'s aligned tensor into `block`: token rows, then
    padding rows (the mean of the input's token rows)."""
    real = max(0, min(len(block), len(vocabulary.rows[source]) - first_row))
    if real:
        _token_rows(vocabulary, checkpoints, source, name, block[:real], first_row)
    if real < len(block):
        block[real:] = np.frombuffer(_padding_row(vocabulary, checkpoints, source, name), np.uint8)


def _token_rows(
    vocabulary: FilledVocabulary, checkpoints: Sequence[Checkpoint], source: int, name: str,
    block: Block, first_row: int,
) -> None:  # fmt: skip
    tokens = np.arange(first_row, first_row + len(block))
    own = _rows_of(vocabulary, source, tokens)
    own[np.frombuffer(vocabulary.forced, np.int8)[tokens] != 0] = -1
    has = np.flatnonzero(own >= 0)
    _read_rows(checkpoints[source], name, own[has], block, has)
    lacking = np.flatnonzero(own < 0)
    if not lacking.size:
        return
    fill = np.frombuffer(vocabulary.fill, np.int64)[tokens[lacking]]
    for donor in np.unique(fill[fill >= 0]):
        at = lacking[fill == donor]
        rows = _donor_rows(vocabulary, int(donor), tokens[at])
        _read_rows(checkpoints[donor], name, rows, block, at)
    block[lacking[fill == ZERO]] = 0
    averaged = lacking[fill == MEAN]
    if averaged.size:
        block[averaged] = _mean_rows(vocabulary, checkpoints, name, tokens[averaged])


def _donor_rows(vocabulary: FilledVocabulary, donor: int, tokens: Ints) -> Ints:
    """The rows input `donor` gives `tokens`: a `tokens` entry's named row, else its own."""
    named = np.frombuffer(vocabulary.fill_row, np.int64)[tokens]
    return np.where(named >= 0, named, _rows_of(vocabulary, donor, tokens))


def _padding_row(
    vocabulary: FilledVocabulary, checkpoints: Sequence[Checkpoint], source: int, name: str
) -> bytes:
    """Input `source`'s padding row of `name`: torch.mean of its aligned token rows, in the
    tensor's dtype, as mergekit computes it (cascade.py); computed once per input and tensor,
    reading the token rows a bounded block at a time."""
    found = vocabulary.means.get((source, name))
    if found is not None:
        return found
    info = checkpoints[source].tensors[name]
    width, count = row_length(info), len(vocabulary.rows[source])
    wide = np.float64 if info.dtype == "F64" else np.float32
    total = RowSum(count, width, wide)
    step = max(1, MEAN_BLOCK_BYTES // (width * info.itemsize))
    block = np.empty((min(step, count), width * info.itemsize), np.uint8)
    for first in range(0, count, step):
        rows = block[: min(step, count - first)]
        _token_rows(vocabulary, checkpoints, source, name, rows, first)
        total.add(_widened(rows, info.dtype))
    mean = total.total() / wide(count)
    found = _narrowed(mean.reshape(1, -1), info.dtype).tobytes()
    vocabulary.means[(source, name)] = found
    return found


def _rows_of(vocabulary: FilledVocabulary, source: int, tokens: Ints) -> Ints:
    rows: Ints = np.frombuffer(vocabulary.rows[source], np.int64)[tokens]
    return rows


def _read_rows(checkpoint: Checkpoint, name: str, rows: Ints, block: Block, at: Ints) -> None:
    """block[at[k]] = row rows[k] of the checkpoint's tensor, one read per run of rows that
    are consecutive both in the file and in the block."""
    if not rows.size:
        return
    info = checkpoint.tensors[name]
    row_bytes = block.shape[1]
    breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(at) != 1)) + 1
    for run_rows, run_at in zip(np.split(rows, breaks), np.split(at, breaks), strict=True):
        target = block[run_at[0] : run_at[-1] + 1].reshape(-1)
        checkpoint.read_into(info, target.data, int(run_rows[0]) * row_bytes)


def _mean_rows(
    vocabulary: FilledVocabulary, checkpoints: Sequence[Checkpoint], name: str, tokens: Ints
) -> Block:
    """The mean of the rows of the inputs that have each token, as mergekit computes it in the
    checkpoints' dtype: from zero, adding in input order, then dividing by the count, every
    step rounded to that dtype. The bytes, in that dtype."""
    info = checkpoints[0].tensors[name]
    width = row_length(info)
    total = np.zeros((tokens.size, width), np.float64 if info.dtype == "F64" else np.float32)
    count = np.zeros(tokens.size, np.int64)
    for source, checkpoint in enumerate(checkpoints):
        rows = _rows_of(vocabulary, source, tokens)
        has = np.flatnonzero(rows >= 0)
        if not has.size:
            continue
        raw = np.empty((has.size, width * info.itemsize), np.uint8)
        _read_rows(checkpoint, name, rows[has], raw, np.arange(has.size))
        total[has] = _rounded(total[has] + _widened(raw, info.dtype), info.dtype)
        count[has] += 1
    total /= count.astype(total.dtype)[:, None]
    return _narrowed(total, info.dtype).view(np.uint8).reshape(tokens.size, -1)


def _widened(raw: Block, dtype: str) -> npt.NDArray[Any]:
    """Rows of raw bytes in `dtype` as float32 (float64 for F64): exact."""
    if dtype == "BF16":  # the upper half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return raw.view(_NUMPY[dtype]).astype(np.float64 if dtype == "F64" else np.float32)


def _narrowed(values: npt.NDArray[Any], dtype: str) -> npt.NDArray[Any]:
    if dtype == "BF16":
        return narrow(values.reshape(-1), "BF16").reshape(values.shape)
    return values.astype(_NUMPY[dtype])


def _rounded(values: npt.NDArray[Any], dtype: str) -> npt.NDArray[Any]:
    """`values` rounded to `dtype` and widened back (a no-op for F32 and F64)."""
    if dtype in ("F32", "F64"):
        return values
    return _widened(_narrowed(values, dtype).view(np.uint8), dtype)
