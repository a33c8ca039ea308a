"""The producer loop: walks the plan in file order and feeds the output writer.

Copies are handed to the writer as file ranges (never decoded); computed tensors are
produced chunk by chunk while the writer and hasher threads drain earlier chunks, so reading,
arithmetic, writing and hashing overlap. Cancellation is checked between tensors and chunks.
"""

from __future__ import annotations

import os
import time
from typing import Any

from worker.engine.errors import MergeCanceled
from worker.engine.kernels import Kernels
from worker.engine.plan import Plan, TensorPlan
from worker.engine.progress import CancelCheck, Progress, ProgressCallback
from worker.engine.writer import OutputWriter

READ_AHEAD = 64 * 1024 * 1024


def stream_shards(
    plan: Plan,
    writer: OutputWriter,
    *,
    device: Any,
    chunk_elements: int,
    on_progress: ProgressCallback | None,
    should_cancel: CancelCheck | None,
    started: float,
) -> None:
    from worker.engine.merge import shard_header

    kernels = Kernels(plan, device=device, chunk_elements=chunk_elements)
    headers = [shard_header(plan, shard) for shard in plan.shards]
    total = plan.total_bytes + sum(len(h) for h in headers)
    done_tensors = 0

    def report(stage: str) -> None:
        if on_progress is not None:
            on_progress(
                Progress(stage, writer.bytes_hashed, total, done_tensors, len(plan.tensors),
                         time.monotonic() - started)
            )  # fmt: skip

    def check_cancel() -> None:
        if should_cancel is not None and should_cancel():
            raise MergeCanceled("merge canceled; no output was left behind")

    try:
        report("merging")
        for shard, header in zip(plan.shards, headers, strict=True):
            writer.begin_file(shard.filename, header)
            for index in shard.tensors:
                check_cancel()
                _stream_tensor(plan, plan.tensors[index], writer, kernels, check_cancel)
                done_tensors += 1
                report("merging")
            writer.end_file()
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    report("finalizing")


def _stream_tensor(
    plan: Plan,
    tensor: TensorPlan,
    writer: OutputWriter,
    kernels: Kernels,
    check_cancel: CancelCheck | Any,
) -> None:
    if tensor.op == "copy":
        checkpoint = plan.checkpoints[tensor.terms[0].source]
        info = checkpoint.tensors[tensor.name]
        writer.put_copy(checkpoint.fd(info.file), info.start, info.nbytes)
        return
    _advise_read_ahead(plan, tensor)
    for chunk in kernels.chunks(tensor):
        check_cancel()
        writer.put_bytes(chunk.view(-1).view(_uint8()).numpy().data)


def _advise_read_ahead(plan: Plan, tensor: TensorPlan) -> None:
    """Ask the kernel to start reading this tensor's inputs while earlier work proceeds."""
    sources = {t.source for t in tensor.terms}
    if plan.ties is not None:
        sources.add(plan.ties.base)
    for source in sources:
        checkpoint = plan.checkpoints[source]
        info = checkpoint.tensors[tensor.name]
        os.posix_fadvise(
            checkpoint.fd(info.file), info.start, min(info.nbytes, READ_AHEAD),
            os.POSIX_FADV_WILLNEED,
        )  # fmt: skip


def _uint8() -> Any:
    import torch

    return torch.uint8
