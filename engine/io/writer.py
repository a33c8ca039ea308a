"""Output files assembled in order, hashed from memory, written past the page cache.

Every output file's header is known before a byte is written, so every tensor has a fixed
offset, and the producer can hand over its pieces out of order: copies up front, as ranges of
input files (nothing read yet), computed chunks as they come — those in file order, since
chunks waiting beyond the cap below stall the producer. Per file, an assembling thread
walks the file in order, filling block-sized buffers from those pieces (copies by one read of
the input's page cache), and hashing each slice of a block as soon as it is filled, while
it is still in the core's cache, so the sha256 is of the very bytes written. Each full block
goes at once to the writing threads, which write it with O_DIRECT: to the disk without a
second copy into the page cache. On a small VM, filling the page cache with a multi-GB output
cost more CPU than anything else in a merge (README, Benchmarks), and a durable output's
fdatasync then only flushes what is already on its way.

Files are assembled side by side (one thread each, a few at a time), since each sha256 is
inherently serial. A file system that refuses O_DIRECT gets the same blocks through the page
cache, with writeback started as they go.

Memory is bounded: computed chunks waiting for their turn are capped at `max_buffered` bytes,
and blocks come from a small pool.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import DiskFull, OutputError, is_disk_full
from engine.io import libc

BLOCK = 8 * 1024 * 1024
HASH_SLICE = 512 * 1024  # well within a core's L2 cache
ALIGN = 4096  # O_DIRECT's unit for offsets, lengths and buffer addresses (a 512-byte disk's too)
LANES = max(1, min(4, os.cpu_count() or 1))  # files assembled and hashed side by side
WRITING_THREADS = 2  # two writes in flight keep the disk busy between them
WRITEBACK_BYTES = 64 * 1024 * 1024  # without O_DIRECT: start writeback this often


@dataclass(frozen=True)
class _Copy:
    src: int
    src_offset: int
    length: int
    ends_tensor = True  # a copy is always one whole tensor (what is left of it, once split)
    buffered = False

    def fill(self, view: memoryview, skip: int) -> None:
        _read_all(self.src, view, self.src_offset + skip)

    def after(self, n: int) -> _Copy:
        return _Copy(self.src, self.src_offset + n, self.length - n)


@dataclass(frozen=True)
class _Bytes:
    data: memoryview
    ends_tensor: bool
    buffered: bool = True  # counted against max_buffered (the header is not)

    @property
    def length(self) -> int:
        return len(self.data)

    def fill(self, view: memoryview, skip: int) -> None:
        view[:] = self.data[skip : skip + len(view)]

    def after(self, n: int) -> _Bytes:
        return _Bytes(self.data[n:], self.ends_tensor, self.buffered)


@dataclass
class _Block:
    file: _File
    offset: int
    buffer: mmap.mmap
    length: int


@dataclass
class _File:
    name: str
    fd: int
    size: int
    direct: bool
    pieces: dict[int, _Copy | _Bytes] = field(default_factory=dict)  # by output offset
    sha: hashlib._Hash = field(default_factory=hashlib.sha256)
    blocks_out: int = 0  # assembled, not yet written
    unflushed: int = 0  # through the page cache: bytes written since writeback was started


class OutputWriter:
    def __init__(
        self,
        directory: Path,
        files: list[tuple[str, bytes, int]],
        *,
        durable: bool = True,
        max_buffered: int = 32 * 1024 * 1024,
        direct: bool = True,
    ) -> None:
        """`files`: (name, header, total size) of each output file. `direct=False` writes
        through the page cache, as it does anyway where the file system refuses O_DIRECT."""
        self.durable = durable
        self.bytes_written = 0
        self.tensors_written = 0
        self.digests: dict[str, str] = {}
        self._files: list[_File] = []
        self._buffered = 0
        self._max_buffered = max_buffered
        self._closed = False
        self._error: BaseException | None = None
        self._state = threading.Condition()
        self._next_file = 0  # index of the next file an assembling thread takes
        self._lanes_running = min(len(files), LANES)
        self._to_write: deque[_Block] = deque()
        self._free: list[mmap.mmap] = []
        self._blocks_made = 0
        self._max_blocks = 3 * self._lanes_running + WRITING_THREADS
        self._create_files(directory, files, direct)
        self._threads = [
            *(self._start(self._assemble_loop) for _ in range(self._lanes_running)),
            *(self._start(self._write_loop) for _ in range(WRITING_THREADS)),
        ]

    def _create_files(
        self, directory: Path, files: list[tuple[str, bytes, int]], direct: bool
    ) -> None:
        """Create every output file, its header the first piece to write; on any failure close
        what was opened (no descriptor outlives a writer that failed to start)."""
        try:
            for name, header, size in files:
                fd, is_direct = _create(directory / name, direct)
                self._files.append(_File(name, fd, size, is_direct))
                if header:
                    self._files[-1].pieces[0] = _Bytes(memoryview(header), False, buffered=False)
        except BaseException as e:  # cleanup on any exit, then re-raised (an OSError as ours)
            self._close()
            if isinstance(e, OSError):
                if is_disk_full(e):
                    raise DiskFull.at(directory, "the output files") from None
                raise OutputError(f"cannot create the output files in {directory}: {e}") from None
            raise

    def _start(self, loop: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=self._guard, args=(loop,), daemon=True)
        thread.start()
        return thread

    # -- producer side -------------------------------------------------------------------
    def put_copy(self, file: int, offset: int, src: int, src_offset: int, length: int) -> None:
        """Have `length` bytes of file descriptor `src` at `src_offset` land at `offset`."""
        with self._state:
            self._raise_if_failed()
            if length:
                self._files[file].pieces[offset] = _Copy(src, src_offset, length)
            else:
                self.tensors_written += 1
            self._state.notify_all()

    def put_bytes(self, file: int, offset: int, data: memoryview, *, ends_tensor: bool) -> None:
        """Hand over computed bytes; blocks while too many are waiting for their turn."""
        with self._state:
            self._state.wait_for(
                lambda: self._error is not None or self._buffered < self._max_buffered
            )
            self._raise_if_failed()
            if len(data):
                self._files[file].pieces[offset] = _Bytes(data, ends_tensor)
                self._buffered += len(data)
            else:
                self.tensors_written += ends_tensor
            self._state.notify_all()

    def finish(self, on_tick: Callable[[], None] | None = None, tick_s: float = 0.5) -> None:
        """Wait for every write and hash (calling `on_tick` now and then); record digests."""
        with self._state:
            self._closed = True
            self._state.notify_all()
        for thread in self._threads:
            alive = True
            while alive:  # at least one tick per thread, so callers see the drain happen
                thread.join(tick_s)
                alive = thread.is_alive()
                if on_tick is not None:
                    on_tick()
        self._close()
        self._raise_if_failed()

    def wait_written(self, seen: int, timeout: float, stop: Callable[[], bool]) -> int:
        """bytes_written once it differs from `seen`, or `stop()` is true (checked again on
        `wake`), or after `timeout` seconds: a progress reporter follows the writes with it."""
        with self._state:
            self._state.wait_for(lambda: self.bytes_written != seen or stop(), timeout)
            return self.bytes_written

    def wake(self) -> None:
        """Have every wait_written look at its `stop` again."""
        with self._state:
            self._state.notify_all()

    def abort(self) -> None:
        with self._state:
            if self._error is None:
                self._error = OutputError("output aborted")
            self._closed = True
            self._state.notify_all()
        for thread in self._threads:
            thread.join()
        self._close()

    def _raise_if_failed(self) -> None:
        error = self._error
        if error is None:
            return
        if is_disk_full(error):
            raise DiskFull("no space left on the device while writing the output") from error
        if isinstance(error, OSError):
            raise OutputError(f"writing the output failed: {error}") from error
        raise error

    # -- threads ---------------------------------------------------------------------------
    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as e:  # a writer thread's boundary: kept for _raise_if_failed
            with self._state:
                if self._error is None:
                    self._error = e
                self._state.notify_all()

    def _assemble_loop(self) -> None:
        """Take the next file not yet taken and assemble it, until none is left."""
        try:
            while True:
                with self._state:
                    if self._next_file >= len(self._files) or self._error is not None:
                        return
                    out = self._files[self._next_file]
                    self._next_file += 1
                if not self._assemble_file(out):
                    return
        finally:
            with self._state:
                self._lanes_running -= 1
                self._state.notify_all()

    def _assemble_file(self, out: _File) -> bool:
        """Assemble and hash the file block by block, in order; then make it durable and record
        its digest. False on an error."""
        for offset in range(0, out.size, BLOCK):
            if not self._assemble(out, offset, min(BLOCK, out.size - offset)):
                return False
        with self._state:
            self._state.wait_for(lambda: self._error is not None or not out.blocks_out)
            if self._error is not None:
                return False
        os.ftruncate(out.fd, out.size)  # an O_DIRECT last block was written padded
        if self.durable:
            os.fdatasync(out.fd)
        self.digests[out.name] = out.sha.hexdigest()
        return True

    def _assemble(self, out: _File, offset: int, length: int) -> bool:
        """Fill a block with the file's bytes at `offset` and queue it; False on an error."""
        buffer = self._take_buffer()
        if buffer is None:
            return False
        view = memoryview(buffer)
        filled = 0
        while filled < length:
            at = offset + filled
            piece = self._piece_at(out, at)
            if piece is None:
                return False
            n = min(length - filled, piece.length)
            _fill_and_hash(out, view, filled, piece, n)
            rest: _Copy | _Bytes | None = None  # what a block boundary leaves of the piece
            if n < piece.length:
                rest = piece.after(n)
            filled += n
            with self._state:
                if rest is not None:
                    out.pieces[at + n] = rest
                else:
                    self.tensors_written += piece.ends_tensor
                if piece.buffered:
                    self._buffered -= n
                    self._state.notify_all()
        block = _Block(out, offset, buffer, length)
        with self._state:
            out.blocks_out += 1
            self._to_write.append(block)
            self._state.notify_all()
        return True

    def _piece_at(self, out: _File, offset: int) -> _Copy | _Bytes | None:
        """Wait for the piece of `out` that starts at `offset`; None on an error."""
        with self._state:
            self._state.wait_for(
                lambda: self._error is not None or offset in out.pieces or self._closed
            )
            if self._error is None and offset not in out.pieces:
                self._error = OutputError(f"{out.name}: bytes at {offset} never written")
            if self._error is not None:
                return None
            return out.pieces.pop(offset)

    def _take_buffer(self) -> mmap.mmap | None:
        """A free block (page-aligned, as O_DIRECT needs), made on first use up to the pool's
        size; None on an error."""
        with self._state:
            self._state.wait_for(
                lambda: (
                    self._error is not None
                    or bool(self._free)
                    or self._blocks_made < self._max_blocks
                )
            )
            if self._error is not None:
                return None
            if self._free:
                return self._free.pop()
            self._blocks_made += 1
        return mmap.mmap(-1, BLOCK)

    def _write_loop(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(
                    lambda: (
                        self._error is not None or bool(self._to_write) or not self._lanes_running
                    )
                )
                if self._error is not None or not self._to_write:
                    return
                block = self._to_write.popleft()
            self._write(block)
            with self._state:
                self.bytes_written += block.length
                self._state.notify_all()  # for wait_written
            self._done_with(block)

    def _write(self, block: _Block) -> None:
        out, view = block.file, memoryview(block.buffer)
        if out.direct:
            padded = -(-block.length // ALIGN) * ALIGN
            view[block.length : padded] = bytes(padded - block.length)
            try:
                _pwrite_all(out.fd, view[:padded], block.offset)
                return
            except OSError as e:  # alignment stricter than ours: go through the page cache
                if e.errno != errno.EINVAL:
                    raise
                with self._state:
                    if out.direct:
                        flags = fcntl.fcntl(out.fd, fcntl.F_GETFL)
                        fcntl.fcntl(out.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                        out.direct = False
        _pwrite_all(out.fd, view[: block.length], block.offset)
        if self.durable:
            with self._state:
                out.unflushed += block.length
                flush = out.unflushed >= WRITEBACK_BYTES
                if flush:
                    out.unflushed = 0
            if flush:
                start_writeback(out.fd)

    def _done_with(self, block: _Block) -> None:
        with self._state:
            self._free.append(block.buffer)
            block.file.blocks_out -= 1
            self._state.notify_all()

    def _close(self) -> None:
        for out in self._files:
            if out.fd >= 0:
                os.close(out.fd)
                out.fd = -1
        self._free.clear()


def _create(path: Path, direct: bool) -> tuple[int, bool]:
    """Create the file for writing, with O_DIRECT where asked and the file system allows it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


_SYNC_FILE_RANGE = libc.function(
    "sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Have the kernel start writing the file's dirty pages now (without waiting for them), so
    that the final fdatasync of a durable output finds little left to write. Best effort."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _fill_and_hash(out: _File, view: memoryview, at: int, piece: _Copy | _Bytes, n: int) -> None:
    """Put the piece's first `n` bytes at `view[at:]`, hashing them a slice at a time while
    that slice is still in this core's cache: hashing a block after it left the cache ran at
    60% of the speed."""
    for start in range(0, n, HASH_SLICE):
        part = view[at + start : at + min(n, start + HASH_SLICE)]
        piece.fill(part, start)
        out.sha.update(part)


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OutputError("input ended while copying (file truncated?)")
        view, offset = view[n:], offset + n


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
