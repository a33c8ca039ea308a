"""The arithmetic: turns one planned tensor into output bytes, a chunk of elements at a time.

Linear ops accumulate in float32 (float64 for F64 inputs) in term order and round once to the
output dtype. TIES first selects each delta's top-k over the whole tensor (top_k.py),
then combines chunk by chunk; the sparsifying methods are sparse_torch.py's; nuslerp and
model_stock measure angles first (angle_torch.py); multislerp and karcher, sce and arcee_fusion
take statistics of the whole tensor first (sphere_torch.py, sce_torch.py, fusion_torch.py);
nearswap is elementwise (nearswap_torch.py), and so are ram and ramplus_tl after a count over
the tensor (ram_torch.py).

In mergekit's narrow arithmetic (a recipe's `arithmetic` bfloat16 or float16: plan/arithmetic.py)
the inputs are rounded to that dtype as they are read, and each tensor's result before it is
written; task arithmetic and TIES (narrow.py, compiled; narrow_torch.py), the sparsifying
methods (narrow_torch.py) and the angle methods then compute in it, as mergekit does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from functools import partial

import torch

from engine.io.memory import keep_freed_memory
from engine.kernels.angle_torch import RULES, AngleMerge
from engine.kernels.fusion_torch import Fusion
from engine.kernels.input_rows import InputRows
from engine.kernels.interpolation_torch import Read, ReadInto, Slerp, weighted
from engine.kernels.narrow_torch import (
    NARROW,
    SORTED_ELEMENTS,
    NarrowSparseMerge,
    NarrowTaskVectors,
    Selection,
    sorted_mask,
)
from engine.kernels.nearswap_torch import nearswap
from engine.kernels.ram_torch import Ram
from engine.kernels.sce_torch import Sce
from engine.kernels.sparse_torch import SparseMerge
from engine.kernels.sphere_torch import Karcher, MultiSlerp
from engine.kernels.tensor_io import TORCH_DTYPES, read_planned
from engine.kernels.top_k import ChunkSource, TopK, top_k, trim_
from engine.kernels.workspace import Workspace
from engine.plan.arithmetic import tensor_arithmetic
from engine.plan.model import Plan, TensorPlan, TiesSettings

# (start, count) -> one chunk of a tensor's output, in the arithmetic dtype
Compute = Callable[[int, int], torch.Tensor]
# torch's threads for CPU arithmetic: two cores are left to the writer (hashing, writing).
CPU_THREADS = max(1, (os.cpu_count() or 1) - 2)


class Kernels:
    def __init__(
        self,
        plan: Plan,
        *,
        device: str,
        chunk_elements: int,
        check_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        keep_freed_memory()  # chunk buffers are reused, not page-faulted in again
        # Raises when the merge is canceled; called per chunk of TIES's top-k passes, which read
        # a whole tensor several times before its first output byte.
        self.check_cancel = check_cancel or (lambda: None)
        self.device = torch.device(device)
        self.default_threads = torch.get_num_threads()  # chunks() lowers it while it computes
        # Arithmetic runs on quarter chunks: its float32 temporaries (a dozen for TIES) then
        # stay in the CPU's cache instead of going to memory and back between steps
        # (measured on 1.7B parameters: soup 9.4 -> 6.8 s, TIES about 1.5x faster).
        self.compute_elements = max(1, chunk_elements // 4)
        # Top-k selection gathers |δ| of a tensor of up to 8 chunks (every layer weight at the
        # default) into one buffer and partitions it: one pass, where the radix select that
        # larger tensors need makes two and histograms both (measured ~3x slower). Slerp keeps
        # both inputs of such a tensor, widened, between its three passes.
        self.selection_elements = chunk_elements
        self.selection_in_memory = 8 * chunk_elements
        # mergekit's narrow arithmetic: a tensor of up to this many entries is selected from
        # by sorting it whole, as mergekit does (narrow_torch.py)
        self.sorted_elements = min(self.selection_in_memory, SORTED_ELEMENTS)
        self.workspace = Workspace(self.device)
        # bytes as read, before they are widened into the device's buffers
        self._staging = Workspace(torch.device("cpu"))
        # The tensor in progress: the narrow dtype its inputs and result are rounded to
        # (mergekit's bf16 or fp16 arithmetic), and the dtype it computes in (None: float32,
        # float64 for F64 inputs). Set by chunks().
        self._rounded: torch.dtype | None = None
        self._compute: torch.dtype | None = None

    def chunks(self, tensor: TensorPlan) -> Iterator[torch.Tensor]:
        """Output chunks (CPU tensors of the output dtype) covering the tensor in order."""
        previous = torch.get_num_threads()
        if self.device.type == "cpu":
            # The writer's threads hash and write beside this one: torch's OpenMP threads,
            # spinning at their barriers on cores those threads hold, made each elementwise op
            # ~10x slower (a 0.25B slerp: 31 -> 4 s with one thread, measured).
            torch.set_num_threads(CPU_THREADS)
        arithmetic = tensor_arithmetic(self.plan, tensor)
        self._rounded = TORCH_DTYPES[arithmetic.rounded] if arithmetic.rounded else None
        self._compute = TORCH_DTYPES[arithmetic.compute]
        round_result = self._rounded is not None and arithmetic.result_rounded
        try:
            for chunk in self._outputs(tensor):
                if round_result:  # mergekit's result, in its dtype
                    chunk = chunk.to(self._rounded)
                yield chunk.to(TORCH_DTYPES[tensor.dtype]).cpu()
        finally:
            torch.set_num_threads(previous)

    def _outputs(self, tensor: TensorPlan) -> Iterator[torch.Tensor]:
        if tensor.op in RULES:  # angles per row or column: chunks of whole rows, its own
            merge = AngleMerge(self._reader(tensor), tensor, chunk=self.selection_elements,
                               block=self.compute_elements)  # fmt: skip
            yield from merge.chunks()
            return
        numel = math.prod(tensor.shape)
        if self._compute in NARROW and tensor.op in ("ties", "task_arithmetic"):
            compute = self._narrow_task_vectors(tensor)
        else:
            compute = self._computations[tensor.op](tensor)
        step = self.compute_elements
        for start in range(0, numel, step):
            yield compute(start, min(step, numel - start))

    @property
    def _computations(self) -> dict[str, Callable[[TensorPlan], Compute]]:
        """Per op: what computes one tensor's chunks (some first read the whole tensor)."""
        return {
            "linear": lambda tensor: partial(self._linear, tensor),
            "ties": self._ties_computation,
            "task_arithmetic": lambda tensor: partial(self._task_arithmetic, tensor),
            "weighted_sum": lambda tensor: partial(weighted, self._reader(tensor), tensor),
            "weighted_mean": lambda tensor: partial(weighted, self._reader(tensor), tensor),
            "slerp": lambda tensor: self._slerp(tensor).chunk,
            "sparsify": self._sparse_computation,
            "multislerp": self._whole_tensor_computation,
            "karcher": self._whole_tensor_computation,
            "nearswap": lambda tensor: partial(nearswap, self._reader(tensor), tensor),
            "sce": self._whole_tensor_computation,
            "arcee_fusion": self._whole_tensor_computation,
            "ram": self._ram_computation,
            "ramplus_tl": self._ram_computation,
        }

    def _ram_computation(self, tensor: TensorPlan) -> Compute:
        # ramplus_tl's counting pass by compute blocks too: by whole chunks its masks and int64
        # counts kept the heap at 684 MB (1.7B pair, bf16), by blocks at 511; counts are exact
        merge = Ram(self._reader(tensor), tensor, chunk=self.compute_elements)
        merge.threads = self.default_threads
        return merge.chunk

    def _whole_tensor_computation(self, tensor: TensorPlan) -> Compute:
        """multislerp, karcher, sce, arcee_fusion: statistics of the whole tensor first, taken
        on the process's default threads where they must equal mergekit's sums."""
        read, chunk = self._reader(tensor), self.selection_elements
        merge: MultiSlerp | Karcher | Sce | Fusion
        if tensor.op == "multislerp":
            merge = MultiSlerp(read, tensor, chunk=chunk, read_into=self._reader_into(tensor))
        elif tensor.op == "karcher":
            merge = Karcher(read, tensor, chunk=chunk, check_cancel=self.check_cancel)
        elif tensor.op == "sce":
            merge = Sce(read, tensor, chunk=chunk, in_memory=self.selection_in_memory)
        else:
            merge = Fusion(read, tensor, chunk=chunk)
        merge.threads = self.default_threads
        return merge.chunk

    def _slerp(self, tensor: TensorPlan) -> Slerp:
        info = self.plan.checkpoints[tensor.terms[0].source].tensors[tensor.read_name]
        wide = self._compute or _wide(TORCH_DTYPES[info.dtype])  # both inputs have one dtype
        return Slerp(
            self._reader_into(tensor), tensor, step=self.selection_elements,
            cache_elements=self.selection_in_memory, workspace=self.workspace,
            dtype=wide, output=self._rounded or TORCH_DTYPES[tensor.dtype],
        )  # fmt: skip

    def _reader(self, tensor: TensorPlan) -> Read:
        def read(source: int, start: int, count: int) -> torch.Tensor:
            self.check_cancel()
            return self._read(source, tensor.read_name, start, count)

        return read

    def _sparse_computation(self, tensor: TensorPlan) -> Compute:
        assert self.plan.sparsify is not None
        kind = NarrowSparseMerge if self._compute in NARROW else SparseMerge
        merge = kind(self._reader(tensor), tensor, self.plan.sparsify, self.selection_elements)
        if isinstance(merge, NarrowSparseMerge):
            merge.sorted_elements, merge.in_memory = self.sorted_elements, self.selection_in_memory
            merge.threads = self.default_threads
        return merge.chunk

    def _reader_into(self, tensor: TensorPlan) -> ReadInto:
        def read_into(source: int, start: int, out: torch.Tensor) -> None:
            self.check_cancel()
            self._read_into(source, tensor.read_name, start, out)

        return read_into

    def _ties_computation(self, tensor: TensorPlan) -> Compute:
        selections = self._ties_selections(tensor)
        ties_left = [top.ties if top else 0 for top in selections]
        return partial(self._ties, tensor, selections, ties_left)

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a chunk at a time, in order (no copies)."""
        for chunk in self.chunks(tensor):
            yield chunk.view(-1).view(torch.uint8).numpy().data

    def _read(self, source: int, name: str, start: int, count: int) -> torch.Tensor:
        """Elements of an input's tensor in the arithmetic's dtype (rounded to mergekit's
        narrow dtype first, where it computes in one)."""
        raw = read_planned(self.plan, source, name, start, count)
        x = raw.to(self.device)
        if self._rounded is not None:
            x = x.to(self._rounded)
        return x.to(self._compute or _wide(raw.dtype))

    def _read_into(self, source: int, name: str, start: int, out: torch.Tensor) -> None:
        """`out.numel()` elements of input `source`'s tensor `name` from `start`, widened into
        `out` (contiguous, on the device): read straight into it when nothing is to be widened
        on the CPU, else through a staging buffer that is kept (workspace.py)."""
        info = self.plan.checkpoints[source].tensors[name]
        dtype = TORCH_DTYPES[info.dtype]
        rounded = self._rounded if self._rounded not in (None, dtype) else None
        if out.device.type == "cpu" and dtype == out.dtype and rounded is None:
            self.plan.read_into(source, name, out.view(torch.uint8).numpy().data,
                                start * info.itemsize)  # fmt: skip
            return
        raw = self._staging.take("read", torch.uint8, out.numel() * info.itemsize)
        self.plan.read_into(source, name, raw.numpy().data, start * info.itemsize)
        out.copy_(raw.view(dtype) if rounded is None else raw.view(dtype).to(rounded))

    def _linear(self, tensor: TensorPlan, start: int, count: int) -> torch.Tensor:
        acc: torch.Tensor | None = None
        for term in tensor.terms:
            x = self._read(term.source, tensor.read_name, start, count)
            if term.coefficient != 1.0:
                x.mul_(term.coefficient)
            acc = x if acc is None else acc.add_(x)
        assert acc is not None
        return acc

    def _task_arithmetic(self, tensor: TensorPlan, start: int, count: int) -> torch.Tensor:
        """base + λ·Σ c_i·(T_i − base), each step rounded as mergekit's task_arithmetic rounds
        it: the deltas weighted and summed in model order, divided by Σ c_i (in float32; not
        when about 0) with `normalize`, scaled by λ, added to the base. No cancellation, unlike
        the expanded (1 − λΣc)·base + Σ λc_i·T_i."""
        settings = self._ties_settings()
        base = self._read(settings.base, tensor.read_name, start, count)
        mixed: torch.Tensor | None = None
        for term in tensor.terms:
            delta = self._read(term.source, tensor.read_name, start, count).sub_(base)
            if term.coefficient != 1.0:
                delta.mul_(term.coefficient)
            mixed = delta if mixed is None else mixed.add_(delta)
        assert mixed is not None
        if settings.normalize:
            weights = torch.tensor([t.coefficient for t in tensor.terms], dtype=base.dtype)
            divisor = float(weights.sum())  # summed in the arithmetic's dtype, as mergekit
            if abs(divisor) >= 1e-8:
                mixed.div_(divisor)
        if (lambda_ := settings.scale(tensor)) != 1.0:
            mixed.mul_(lambda_)
        return base.add_(mixed)

    def _narrow_task_vectors(self, tensor: TensorPlan) -> Compute:
        """Task arithmetic or TIES in mergekit's bf16 or fp16 arithmetic (narrow_torch.py),
        compiled on the CPU: each delta trimmed to the entries selected, then combined."""
        trimmed = tensor.op == "ties"
        selections: list[Selection] = [None] * len(tensor.terms)
        if trimmed:
            selections = self._narrow_selections(tensor)
        settings = self._ties_settings()
        merge = NarrowTaskVectors(self._reader(tensor), tensor, settings, selections)
        if self.device.type != "cpu":
            return merge.chunk
        sources = [settings.base, *(term.source for term in tensor.terms)]
        stored = {self.plan.checkpoints[s].tensors[tensor.read_name].dtype for s in sources}
        compute = self._compute
        if compute is not None and {TORCH_DTYPES[dtype] for dtype in stored} == {compute}:
            merge.stored = (InputRows(self.plan, keep=True, bits=True), compute)
        return merge.compiled_chunk

    def _narrow_selections(self, tensor: TensorPlan) -> list[Selection]:
        """Each delta's kept entries: mergekit's (torch's sort of the whole |δ|) for a tensor
        that fits in memory, else top_k's (equal |δ| at the cut in flat order)."""
        numel, settings = math.prod(tensor.shape), self._ties_settings()
        if numel > self.sorted_elements:
            return list(self._ties_selections(tensor))
        return [
            None
            if density >= 1.0
            else sorted_mask(self._magnitudes(tensor, t.source)(), numel,
                             (0, settings.kept(numel, density)), descending=True)
            for t, density in zip(tensor.terms, settings.densities(tensor), strict=True)
        ]  # fmt: skip

    def _ties_settings(self) -> TiesSettings:
        assert self.plan.ties is not None
        return self.plan.ties

    def _magnitudes(self, tensor: TensorPlan, source: int) -> ChunkSource:
        """|T_source − base| of the whole tensor, in chunks that still fit in memory."""
        base = self._ties_settings().base

        def chunks() -> Iterator[torch.Tensor]:
            numel = math.prod(tensor.shape)
            step = self.selection_elements
            for start in range(0, numel, step):
                self.check_cancel()
                count = min(step, numel - start)
                x = self._read(source, tensor.read_name, start, count)
                x = x.sub_(self._read(base, tensor.read_name, start, count)).abs_()
                yield x.float() if x.dtype in NARROW else x  # exact: top_k takes float32

        return chunks

    def _ties_selections(self, tensor: TensorPlan) -> list[TopK | None]:
        """Each delta's kept entries (None: every one, at density 1)."""
        numel, settings = math.prod(tensor.shape), self._ties_settings()
        return [
            None
            if density >= 1.0
            else top_k(self._magnitudes(tensor, t.source), settings.kept(numel, density),
                       numel=numel, in_memory=self.selection_in_memory,
                       buffer=self._selected(numel))
            for t, density in zip(tensor.terms, settings.densities(tensor), strict=True)
        ]  # fmt: skip

    def _selected(self, numel: int) -> torch.Tensor | None:
        """The buffer top_k selects from in memory, kept from tensor to tensor: allocated and
        freed for each delta, 46 MB at a time on the 1.7B pair, it grew the heap."""
        if numel > self.selection_in_memory:
            return None
        return self._staging.take("selected", torch.float32, numel)

    def _ties(
        self, tensor: TensorPlan, selections: list[TopK | None], ties_left: list[int],
        start: int, count: int,
    ) -> torch.Tensor:  # fmt: skip
        """base + the disjoint mean of the trimmed, weighted deltas that agree with the sign
        of their sum. The agreeing sum is the sum of the positive parts where that sum is
        ≥ 0, of the negative parts elsewhere (and likewise the divisor), so each input is
        read once; every step is float arithmetic, because torch's boolean-mask kernels
        (where, masked_fill) cost ~20x more per element on CPU. Selecting by multiplying with
        0/1 is exact; the last `+ 0.0` turns a -0.0 sum into +0.0, as masking did."""
        settings = self._ties_settings()
        base = self._read(settings.base, tensor.read_name, start, count)
        positive, negative, up, down = self._signed_sums(
            tensor, selections, ties_left, base, start, count
        )
        # 1.0 where the sum is >= 0 (its sign is 0 or 1), else 0.0
        elected_up = torch.add(positive, negative).sign_().add_(1.0).clamp_max_(1.0)
        elected_down = torch.sub(1.0, elected_up)
        mixed = positive.mul_(elected_up).add_(negative.mul_(elected_down))
        if settings.normalize:
            divisor = up.mul_(elected_up).add_(down.mul_(elected_down))
            divisor.add_(torch.sign(divisor).abs_().sub_(1.0).neg_())  # 0 -> 1
            mixed.div_(divisor)
        if (lambda_ := settings.scale(tensor)) != 1.0:
            mixed.mul_(lambda_)
        return base.add_(mixed.add_(0.0))

    def _signed_sums(
        self, tensor: TensorPlan, selections: list[TopK | None], ties_left: list[int],
        base: torch.Tensor, start: int, count: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Over the trimmed, weighted deltas from `base`: the sum of their positive parts, of
        their negative parts, and of the coefficients of the positive and of the negative ones
        (each input read once)."""
        positive = negative = up = down = base  # assigned by the first term
        for i, (term, top) in enumerate(zip(tensor.terms, selections, strict=True)):
            c = term.coefficient
            delta = self._read(term.source, tensor.read_name, start, count).sub_(base)
            if top is not None:
                ties_left[i] = trim_(delta, top, ties_left[i])
            if c != 1.0:
                delta.mul_(c)
            if i == 0:
                positive, negative = delta.clamp_min(0.0), delta.clamp_max(0.0)
                sign = delta.sign_()
                up, down = sign.clamp_min(0.0).mul_(c), sign.clamp_max_(0.0).mul_(-c)
            else:
                positive.add_(delta.clamp_min(0.0))
                negative.add_(delta.clamp_max(0.0))
                sign = delta.sign_()
                up.add_(sign.clamp_min(0.0), alpha=c)
                down.sub_(sign.clamp_max_(0.0), alpha=c)
        return positive, negative, up, down


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype for inputs of `dtype`: float64 for F64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
