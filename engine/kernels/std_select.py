"""torch.topk's choice of the k largest entries on the CPU, to the entry.

Of the entries equal to the k-th largest value, which ones torch.topk returns depends on how
libstdc++'s algorithms moved its (value, index) pairs, so those moves are made again here, on
a float32 copy of the values and an int32 copy of the indices (8 bytes an entry, where torch
holds 16; bfloat16 values as their 2 bytes):

- with k·64 ≤ n, std::partial_sort's selection: a heap of the first k entries (the smallest
  on top, by std::make_heap); each later entry larger than the top replaces it and sinks to
  its place (std::__pop_heap);
- else std::nth_element: introselect (quickselect with the median of the second, middle and
  last entries moved first as the pivot; a heap selection once 2·⌊log2 n⌋ rounds have not
  narrowed it to 3 entries; then an insertion sort of those).

"Larger" is torch's comparison: NaN above every number, else `>`.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

from engine.kernels.float_bits import as_number

Array = Any  # a numpy array, as compiled code takes it
_jit = numba.njit(nogil=True, cache=True)
_helper = numba.njit(cache=True)  # called by the kernels; LLVM inlines it there
HEAP_BELOW = 64  # k·64 ≤ n: the heap of k entries


def keys(values: torch.Tensor) -> Array:
    """The values as torch.topk compares them, in few bytes: bfloat16 as its bits (uint16),
    float16 widened to float32 (exact), float32 and float64 as they are."""
    values = values.reshape(-1).cpu()
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16).numpy().view(np.uint16)
    if values.dtype == torch.float16:
        return values.float().numpy()
    return values.numpy()


def top_k_mask(held: Array, k: int) -> Array:
    """A bool mask of the entries torch.topk(values, k, largest=True) returns, from their
    keys(); `held` is reordered (nth_element works in place)."""
    n = held.size
    mask = np.zeros(n, np.bool_)
    if k >= n:
        mask[:] = True
    elif k > 0:
        if k * HEAP_BELOW <= n:
            vals, idx = held[:k].copy(), np.arange(k, dtype=np.int32)
            _stream_heap(vals, idx, held)
        else:
            vals, idx = held, np.arange(n, dtype=np.int32)
            _nth_element(vals, idx, k - 1)
        mask[idx[:k]] = True
    return mask


@_helper
def _larger(a: Any, b: Any) -> Any:
    x, y = as_number(a), as_number(b)
    return (x != x and y == y) or x > y


@_helper
def _swap(vals: Array, idx: Array, a: int, b: int) -> None:
    vals[a], vals[b] = vals[b], vals[a]
    idx[a], idx[b] = idx[b], idx[a]


@_helper
def _push_heap(
    vals: Array, idx: Array, first: int, hole: int, top: int, value: Any, index: Any
) -> None:
    parent = (hole - 1) // 2
    while hole > top and _larger(vals[first + parent], value):
        vals[first + hole] = vals[first + parent]
        idx[first + hole] = idx[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    vals[first + hole] = value
    idx[first + hole] = index


@_helper
def _adjust_heap(
    vals: Array, idx: Array, first: int, hole: int, length: int, value: Any, index: Any
) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _larger(vals[first + child], vals[first + child - 1]):
            child -= 1
        vals[first + hole] = vals[first + child]
        idx[first + hole] = idx[first + child]
        hole = child
    if length & 1 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        vals[first + hole] = vals[first + child - 1]
        idx[first + hole] = idx[first + child - 1]
        hole = child - 1
    _push_heap(vals, idx, first, hole, top, value, index)


@_helper
def _make_heap(vals: Array, idx: Array, first: int, last: int) -> None:
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(vals, idx, first, parent, length, vals[first + parent], idx[first + parent])
        if parent == 0:
            return
        parent -= 1


@_jit
def _stream_heap(vals: Array, idx: Array, flat: Array) -> None:
    """The heap of the k largest, fed every entry after the first k in order."""
    k = len(vals)
    _make_heap(vals, idx, 0, k)
    for i in range(k, len(flat)):
        value = flat[i]
        if _larger(value, vals[0]):  # std::__pop_heap into the entry's place
            _adjust_heap(vals, idx, 0, 0, k, value, i)


@_helper
def _median_to_first(vals: Array, idx: Array, result: int, a: int, b: int, c: int) -> None:
    if _larger(vals[a], vals[b]):
        if _larger(vals[b], vals[c]):
            _swap(vals, idx, result, b)
        elif _larger(vals[a], vals[c]):
            _swap(vals, idx, result, c)
        else:
            _swap(vals, idx, result, a)
    elif _larger(vals[a], vals[c]):
        _swap(vals, idx, result, a)
    elif _larger(vals[b], vals[c]):
        _swap(vals, idx, result, c)
    else:
        _swap(vals, idx, result, b)


@_helper
def _partition(vals: Array, idx: Array, first: int, last: int, pivot: int) -> int:
    while True:
        while _larger(vals[first], vals[pivot]):
            first += 1
        last -= 1
        while _larger(vals[pivot], vals[last]):
            last -= 1
        if not first < last:
            return first
        _swap(vals, idx, first, last)
        first += 1


@_helper
def _insertion_sort(vals: Array, idx: Array, first: int, last: int) -> None:
    for i in range(first + 1, last):
        value, index = vals[i], idx[i]
        if _larger(value, vals[first]):
            for j in range(i, first, -1):
                vals[j], idx[j] = vals[j - 1], idx[j - 1]
            vals[first], idx[first] = value, index
        else:
            j = i
            while _larger(value, vals[j - 1]):
                vals[j], idx[j] = vals[j - 1], idx[j - 1]
                j -= 1
            vals[j], idx[j] = value, index


@_jit
def _nth_element(vals: Array, idx: Array, nth: int) -> None:
    first, last = 0, len(vals)
    depth, size = 0, last  # 2·⌊log2 n⌋ rounds (std::__lg)
    while size > 1:
        size >>= 1
        depth += 2
    while last - first > 3:
        if depth == 0:  # std::__heap_select of the first nth + 1
            middle = nth + 1
            _make_heap(vals, idx, first, middle)
            for i in range(middle, last):
                if _larger(vals[i], vals[first]):
                    value, index = vals[i], idx[i]
                    vals[i], idx[i] = vals[first], idx[first]
                    _adjust_heap(vals, idx, first, 0, middle - first, value, index)
            _swap(vals, idx, first, nth)
            return
        depth -= 1
        _median_to_first(vals, idx, first, first + 1, first + (last - first) // 2, last - 1)
        cut = _partition(vals, idx, first + 1, last, first)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(vals, idx, first, last)
