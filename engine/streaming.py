"""The producer: lays out the output files and feeds the writer.

Copies are handed over first, as file ranges (never decoded, no memory held), so the writer
can assemble, hash and write them at once; then computed tensors are produced chunk by chunk,
in file order, and wait (a bounded amount) for the writer to reach their offsets (io/writer.py).
Linear plans, TIES and the sparsifying methods on the CPU compute in numba-compiled loops on
every core (linear.py, ties.py, sparse.py), and so does mergekit's bf16 or fp16 task arithmetic
(narrow_arithmetic.py); nuslerp and model_stock in numba and torch (angle.py: torch loads
beside the first tensors); torch, a second to import, is loaded only for the rest (CUDA,
float64, slerp, and the rest of mergekit's bf16 or fp16 arithmetic: plan/arithmetic.py), while
the copies are written. A plan that only copies (a frankenmerge) loads no kernels at all.
Cancellation is checked between tensors and chunks; progress is reported by a thread that
follows the writer, block by block (_Feedback).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from engine.errors import MergeCanceled
from engine.io.safetensors_format import encode_header
from engine.io.writer import OutputWriter
from engine.plan.arithmetic import as_float32
from engine.plan.model import ANGLE_OPS, Plan, TensorPlan
from engine.progress import CancelCheck, Progress, ProgressCallback

READ_AHEAD = 64 * 1024 * 1024


def shard_layout(plan: Plan) -> list[tuple[bytes, list[int]]]:
    """Per shard: its header and the absolute file offset of each of its tensors, laid out in
    the shard's order (save_file's: planner.py), header entries and data alike. A computed
    tensor before copies (a layer swap's lm_head) holds up the file's hashing, which is in file
    order, until its kernels are loaded and it is made; other shards are written meanwhile."""
    layout = []
    for shard in plan.shards:
        entries: dict[str, dict[str, Any]] = {}
        starts: list[int] = []
        offset = 0
        for index in shard.tensors:
            t = plan.tensors[index]
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                               "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
            starts.append(offset)
            offset += t.nbytes
        header = encode_header(entries, {"format": "pt"})
        layout.append((header, [len(header) + start for start in starts]))
    return layout


def stream_shards(
    plan: Plan,
    staging: Path,
    *,
    device: str,
    chunk_elements: int,
    durable: bool,
    tick_s: float,
    on_progress: ProgressCallback | None,
    should_cancel: CancelCheck | None,
    started: float,
) -> dict[str, str]:
    """Write every shard into `staging`; return sha256 by file name."""
    layout = shard_layout(plan)
    files = [
        (shard.filename, header, len(header) + sum(plan.tensors[i].nbytes for i in shard.tensors))
        for shard, (header, _) in zip(plan.shards, layout, strict=True)
    ]
    writer = OutputWriter(staging, files, durable=durable)
    total = sum(size for _, _, size in files)
    feedback = _Feedback(writer, total, len(plan.tensors), started, tick_s, on_progress,
                         should_cancel)  # fmt: skip
    try:
        with feedback:
            _write_tensors(plan, layout, writer, device, chunk_elements, feedback)
            writer.finish(on_tick=feedback.check_cancel, tick_s=tick_s)
    except BaseException:  # cleanup only (a cancel included): the writer stops, the error stays
        writer.abort()
        raise
    feedback.report("finalizing")
    return writer.digests


class _Feedback:
    """A merge's progress reports (read from its writer) and its cancel check.

    Inside `with`, reports come from a thread of their own that follows the writer block by
    block (and every `tick_s`), so progress moves however busy the producer is: importing a
    kernel, computing a chunk, or waiting behind GBs of copies for the writer to reach its
    offset. Outside it (the start, "finalizing") the caller reports; the two never overlap."""

    def __init__(
        self,
        writer: OutputWriter,
        total_bytes: int,
        total_tensors: int,
        started: float,  # time.monotonic() when the merge began
        tick_s: float,
        on_progress: ProgressCallback | None,
        should_cancel: CancelCheck | None,
    ) -> None:
        self.writer = writer
        self.total_bytes = total_bytes
        self.total_tensors = total_tensors
        self.started = started
        self.tick_s = tick_s
        self.on_progress = on_progress
        self.should_cancel = should_cancel
        self._stop = threading.Event()
        self._failed: list[BaseException] = []  # raised by on_progress in the reporting thread
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> _Feedback:
        self.report()
        if self.on_progress is not None:
            self._thread.start()
        return self

    def __exit__(self, error_type: type[BaseException] | None, *exc: object) -> None:
        self._stop.set()
        self.writer.wake()
        if self._thread.is_alive():
            self._thread.join()
        if error_type is None:
            self._raise_if_failed()

    def report(self, stage: str = "merging") -> None:
        if self.on_progress is not None:
            self.on_progress(
                Progress(stage, self.writer.bytes_written, self.total_bytes,
                         self.writer.tensors_written, self.total_tensors,
                         time.monotonic() - self.started)
            )  # fmt: skip

    def check_cancel(self) -> None:
        self._raise_if_failed()
        if self.should_cancel is not None and self.should_cancel():
            raise MergeCanceled("merge canceled; no output was left behind")

    def _follow(self) -> None:
        seen = self.writer.bytes_written
        try:
            while True:
                seen = self.writer.wait_written(seen, self.tick_s, self._stop.is_set)
                if self._stop.is_set():
                    return
                self.report()
        except BaseException as e:  # the thread's boundary: the producer raises it
            self._failed.append(e)

    def _raise_if_failed(self) -> None:
        if self._failed:
            raise self._failed[0]


def _write_tensors(
    plan: Plan,
    layout: list[tuple[bytes, list[int]]],
    writer: OutputWriter,
    device: str,
    chunk_elements: int,
    feedback: _Feedback,
) -> None:
    """Hand the writer every copy (file ranges, at once), then each computed tensor chunk by
    chunk, both in file order."""
    placed = sorted(  # in file order: the writer assembles each file from its start
        (
            (file, offset, plan.tensors[index])
            for file, (shard, (_, offsets)) in enumerate(zip(plan.shards, layout, strict=True))
            for index, offset in zip(shard.tensors, offsets, strict=True)
        ),
        key=lambda placement: placement[:2],
    )
    for file, offset, tensor in placed:
        if tensor.op == "copy":
            _queue_copy(plan, tensor, writer, file, offset)
    computed = [(file, offset, tensor) for file, offset, tensor in placed if tensor.op != "copy"]
    if not computed:  # a frankenmerge, a pure layer selection: no kernels to load
        return
    kernels = _kernels(plan, device, chunk_elements, feedback.check_cancel)
    for file, offset, tensor in computed:
        feedback.check_cancel()
        _write_computed(plan, tensor, writer, kernels, file, offset, feedback.check_cancel)


class ChunkKernels(Protocol):
    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]: ...


def _kernels(
    plan: Plan, device: str, chunk_elements: int, check_cancel: Callable[[], None]
) -> ChunkKernels:
    """numba for linear plans, TIES and the sparsifying methods on the CPU, numba and torch for
    nuslerp and model_stock; torch (seconds to import, while the copies run) for the rest. numba
    and torch are imported here, when a plan needs them. numpy too is imported here, by the
    first computed tensor: its BLAS thread pool starts with it, so a process that plans, copies
    or serves the API never starts one, and `layerswap worker --nice` lowers the priority of the
    process before any of its threads exists."""
    compiled: ChunkKernels | None = None
    if as_float32(plan):
        compiled = _compiled_kernels(plan, device, chunk_elements, check_cancel)
    else:  # mergekit's narrower arithmetic (bf16, fp16): compiled for its task arithmetic
        # numpy (numba once it handles the plan): only for mergekit's narrow arithmetic
        from engine.kernels import narrow_arithmetic

        if narrow_arithmetic.handles(plan, device):
            compiled = narrow_arithmetic.NarrowArithmeticKernels(
                plan, chunk_elements=chunk_elements
            )
    if compiled is not None:
        return compiled
    # torch: seconds to import; only for what no compiled kernel handles
    from engine.kernels.torch_kernels import Kernels

    return Kernels(plan, device=device, chunk_elements=chunk_elements, check_cancel=check_cancel)


def _compiled_kernels(
    plan: Plan, device: str, chunk_elements: int, check_cancel: Callable[[], None]
) -> ChunkKernels | None:
    """The numba kernels that compute every tensor of the plan, if some do."""
    # numba and numpy: loaded by the first computed tensor, as said above
    from engine.kernels import linear as linear_kernels

    if linear_kernels.handles(plan, device):
        return linear_kernels.LinearKernels(plan, chunk_elements=chunk_elements)
    # numba: compiled kernels, loaded only for the plans they handle
    from engine.kernels import ties as ties_kernels

    if ties_kernels.handles(plan, device):
        return ties_kernels.TiesKernels(
            plan, chunk_elements=chunk_elements, check_cancel=check_cancel
        )
    # numba: compiled kernels, loaded only for the plans they handle
    from engine.kernels import sparse as sparse_kernels

    if sparse_kernels.handles(plan, device):
        return sparse_kernels.SparseKernels(
            plan, chunk_elements=chunk_elements, check_cancel=check_cancel
        )
    if any(t.op in ANGLE_OPS for t in plan.tensors):
        # numba (torch for nuslerp's sines): only for the angle methods
        from engine.kernels import angle as angle_kernels

        if angle_kernels.handles(plan, device):
            return angle_kernels.AngleKernels(
                plan, chunk_elements=chunk_elements, check_cancel=check_cancel
            )
    return None


def _queue_copy(
    plan: Plan, tensor: TensorPlan, writer: OutputWriter, file: int, offset: int
) -> None:
    checkpoint = plan.checkpoints[tensor.terms[0].source]
    info = checkpoint.tensors[tensor.read_name]
    writer.put_copy(file, offset, checkpoint.fd(info.file), info.start, info.nbytes)


def _write_computed(
    plan: Plan,
    tensor: TensorPlan,
    writer: OutputWriter,
    kernels: ChunkKernels,
    file: int,
    offset: int,
    check_cancel: Callable[[], None],
) -> None:
    _advise_read_ahead(plan, tensor)
    end = offset + tensor.nbytes
    if tensor.nbytes == 0:
        writer.put_bytes(file, offset, memoryview(b""), ends_tensor=True)
    for data in kernels.output_bytes(tensor):
        check_cancel()
        writer.put_bytes(file, offset, data, ends_tensor=offset + len(data) == end)
        offset += len(data)


def _advise_read_ahead(plan: Plan, tensor: TensorPlan) -> None:
    """Ask the kernel to start reading this tensor's inputs while earlier work proceeds."""
    for source in plan.inputs_read(tensor):
        checkpoint = plan.checkpoints[source]
        info = checkpoint.tensors[tensor.read_name]
        os.posix_fadvise(
            checkpoint.fd(info.file), info.start, min(info.nbytes, READ_AHEAD),
            os.POSIX_FADV_WILLNEED,
        )  # fmt: skip
