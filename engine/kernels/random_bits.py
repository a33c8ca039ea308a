"""Random bits for the random drops of DARE and DELLA: Philox4x32-10 (Salmon et al. 2011,
"Parallel random numbers: as easy as 1, 2, 3"), a counter-based generator.

Element j of a tensor's delta of models[i] gets the 32 bits at counter j of the stream keyed by
(seed, tensor name, i): lane j mod 4 of Philox's output for the 128-bit counter (j div 4, 0).
Each element's bits depend on nothing else, so any chunk is generated on its own, on any device,
by any number of threads, and gives the same bits. An entry with keep probability p is kept when
its bits, read as a number u in [0, 2³²), satisfy u < p·2³² (exact in float64).

Compiled with numba for the CPU kernels; engine/kernels/sparse_torch.py computes the same
with torch.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
KEY_STEPS = (0x9E3779B9, 0xBB67AE85)  # the golden ratio and √3 − 1, as 32-bit fractions
ROUNDS = 10
SCALE = 2.0**32  # keep when bits < p·SCALE

_M0, _M1 = np.uint64(MULTIPLIERS[0]), np.uint64(MULTIPLIERS[1])
_W0, _W1 = np.uint64(KEY_STEPS[0]), np.uint64(KEY_STEPS[1])
_LOW = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def stream_key(seed: int, tensor: str, term: int) -> tuple[int, int]:
    """The 64-bit Philox key of one delta's stream: a digest of (seed, name, model index)."""
    digest = hashlib.blake2b(f"{seed}\0{tensor}\0{term}".encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "little")
    return key & 0xFFFFFFFF, key >> 32


@numba.njit(cache=True)
def _round(c0: Any, c1: Any, c2: Any, c3: Any, k0: Any, k1: Any) -> Any:
    p0, p1 = _M0 * c0, _M1 * c2
    return (p1 >> _32) ^ c1 ^ k0, p1 & _LOW, (p0 >> _32) ^ c3 ^ k1, p0 & _LOW


@numba.njit(cache=True)
def _bump(k0: Any, k1: Any) -> Any:
    return (k0 + _W0) & _LOW, (k1 + _W1) & _LOW


@numba.njit(cache=True)
def philox(c0: Any, c1: Any, c2: Any, c3: Any, k0: Any, k1: Any) -> Any:
    """Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1), all 32-bit values held in
    uint64 (the product of two fits). The rounds are written out: a loop over blocks of them
    then vectorises (measured 10x faster than a loop of rounds)."""
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    return _round(c0, c1, c2, c3, k0, k1)


@numba.njit(cache=True)
def _block(block: Any, k0: Any, k1: Any) -> Any:
    counter = np.uint64(block)
    return philox(counter & _LOW, counter >> _32, np.uint64(0), np.uint64(0), k0, k1)


@numba.njit(nogil=True, cache=True)
def fill_bits(first: int, k0: int, k1: int, out: Any) -> None:
    """out[j] = the bits of element first + j: whole Philox blocks (four elements) in one
    vectorised loop, the blocks the range cuts element by element."""
    key0, key1 = np.uint64(k0), np.uint64(k1)
    end = first + out.size
    inner_start = min(end, (first + 3) & ~3)  # the first whole block
    inner_end = max(inner_start, end & ~3)
    for index in range(first, inner_start):
        out[index - first] = _block(index >> 2, key0, key1)[index & 3]
    # a slice indexed from 0 by the loop counter: numba drops its negative-index checks and
    # the loop vectorises (measured 8x)
    inner, first_block = out[inner_start - first : inner_end - first], inner_start >> 2
    for b in range(inner.size >> 2):
        x0, x1, x2, x3 = _block(first_block + b, key0, key1)
        inner[4 * b], inner[4 * b + 1], inner[4 * b + 2], inner[4 * b + 3] = x0, x1, x2, x3
    for index in range(inner_end, end):
        out[index - first] = _block(index >> 2, key0, key1)[index & 3]


@numba.njit(cache=True)
def _philox_of(c0: int, c1: int, c2: int, c3: int, k0: int, k1: int) -> Any:
    u = np.uint64
    return philox(u(c0), u(c1), u(c2), u(c3), u(k0), u(k1))


def philox4x32(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """One Philox4x32-10 block, for checks against published known-answer vectors."""
    return tuple(int(x) for x in _philox_of(*counter, *key))


def random_bits(seed: int, tensor: str, term: int, start: int, count: int) -> npt.NDArray[Any]:
    """The bits (uint32) of elements [start, start + count) of a delta's stream: what decides
    which of its entries a random drop keeps (`bits < p·2³²`)."""
    k0, k1 = stream_key(seed, tensor, term)
    out = np.empty(count, np.uint32)
    fill_bits(start, k0, k1, out)
    return out
