"""Read slices of a checkpoint's tensors into torch: positioned reads, no mmap, no zero-fill.

A tensor is processed in chunks of whole rows (a row = one index of dim 0; a 0-D or 1-D tensor
is a single row) so that memory stays bounded by the chunk size, not by the tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from engine.io.checkpoint import Checkpoint
from engine.io.safetensors_format import TensorInfo
from engine.plan.model import Plan

# safetensors dtype string -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def read_elements(checkpoint: Checkpoint, info: TensorInfo, start: int, count: int) -> torch.Tensor:
    """`count` elements of tensor `info` from flat element index `start`, as a 1-D tensor.

    The bytes land in a fresh uninitialised buffer (`torch.empty`) by positioned reads and are
    reinterpreted, not converted: the result has the tensor's own dtype.
    """
    if start < 0 or count < 0 or start + count > info.numel:
        raise ValueError(
            f"elements [{start}, {start + count}) out of range for {info.name!r} "
            f"({info.numel} elements)"
        )
    itemsize = info.itemsize
    buffer = torch.empty(count * itemsize, dtype=torch.uint8)
    if count:
        checkpoint.read_into(info, buffer.numpy().data, start * itemsize)
    return buffer.view(TORCH_DTYPES[info.dtype])


def read_planned(plan: Plan, source: int, name: str, start: int, count: int) -> torch.Tensor:
    """`count` elements of input `source`'s tensor `name` from `start`, as the plan's output
    sees it (rows aligned to the output vocabulary where they are), in the tensor's dtype."""
    info = plan.checkpoints[source].tensors[name]
    buffer = torch.empty(count * info.itemsize, dtype=torch.uint8)
    if count:
        plan.read_into(source, name, buffer.numpy().data, start * info.itemsize)
    return buffer.view(TORCH_DTYPES[info.dtype])


def row_length(info: TensorInfo) -> int:
    """Elements per row: the product of all dims but the first (a 0-D/1-D tensor is one row)."""
    return math.prod(info.shape[1:]) if len(info.shape) >= 2 else info.numel


def iter_row_chunks(info: TensorInfo, max_elements: int) -> Iterator[tuple[int, int]]:
    """(start_element, element_count) ranges of whole rows, each at most `max_elements` long.

    A chunk always holds at least one row, even if a row alone exceeds `max_elements`.
    An empty tensor yields nothing.
    """
    total, row = info.numel, row_length(info)
    if total == 0 or row == 0:
        return
    step = max(1, max_elements // row) * row
    for start in range(0, total, step):
        yield start, min(step, total - start)
