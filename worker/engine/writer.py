"""Output files written out of order, hashed in order.

Every output file's header is known before a byte is written, so every tensor has a fixed
offset. That lets copies and computed chunks land independently: copies are queued up front as
file ranges (moved in the kernel by copy_file_range, as cp does), computed chunks are written at
their offsets as they come, and the two interleave — the disk is busy while the arithmetic
runs. Hashing threads (one per file at a time, several files side by side) follow behind,
reading each file back in order from the page cache as soon as its next range is complete, so
every sha256 is of the bytes actually written. They read through a memory map, a block at a
time: hashing is the one serial pass over a big file, and a map saves it a copy.

Memory is bounded: computed chunks in flight are capped at `max_buffered` bytes; hashing maps
one block per thread, and copies where copy_file_range is refused use one block-sized buffer.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from worker.engine import libc
from worker.engine.errors import DiskFull, OutputError, is_disk_full

BLOCK = 8 * 1024 * 1024
COPY_PIECE = 64 * 1024 * 1024
HASHING_THREADS = max(1, min(4, os.cpu_count() or 1))  # hashlib releases the GIL
WRITEBACK_BYTES = 64 * 1024 * 1024
# copy_file_range refused: across file systems (older kernels), unsupported, or not a regular file
_NO_COPY_RANGE = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})


@dataclass
class _File:
    name: str
    fd: int
    size: int
    done: dict[int, int] = field(default_factory=dict)  # written ranges: start -> end
    hashed: int = 0
    unflushed: int = 0  # bytes written since its writeback was last started


@dataclass(frozen=True)
class _Copy:
    file: int
    offset: int
    src: int
    src_offset: int
    length: int
    ends_tensor: bool


@dataclass(frozen=True)
class _Bytes:
    file: int
    offset: int
    data: memoryview
    ends_tensor: bool


class OutputWriter:
    def __init__(
        self,
        directory: Path,
        files: list[tuple[str, bytes, int]],
        *,
        durable: bool = True,
        max_buffered: int = 32 * 1024 * 1024,
        copy_in_kernel: bool = True,
        hash_through_map: bool = True,
    ) -> None:
        """`files`: (name, header, total size) of each output file, in hashing order.
        `copy_in_kernel=False` copies through a user-space buffer, as it does anyway once the
        file system refuses copy_file_range; `hash_through_map=False` hashes what it reads into
        a buffer, as it does anyway once the file system refuses a memory map."""
        self.durable = durable
        self.bytes_written = 0
        self.tensors_written = 0
        self.digests: dict[str, str] = {}
        self._files: list[_File] = []
        self._copies: deque[_Copy] = deque()
        self._chunks: deque[_Bytes] = deque()
        self._buffered = 0
        self._max_buffered = max_buffered
        self._closed = False
        self._writer_done = False
        self._error: BaseException | None = None
        self._state = threading.Condition()
        self._copy_in_kernel = copy_in_kernel  # until the file system refuses
        self._hash_through_map = hash_through_map  # likewise
        self._copy_buffer = bytearray(BLOCK)
        self._next_to_hash = 0  # index of the next file a hashing thread takes
        try:
            for name, header, size in files:
                fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._files.append(_File(name, fd, size))
                _pwrite_all(fd, memoryview(header), 0)
                self._files[-1].done[0] = len(header)
                self.bytes_written += len(header)
        except BaseException as e:
            self._close()  # no descriptor outlives a writer that failed to start
            if isinstance(e, OSError):
                if is_disk_full(e):
                    raise DiskFull.at(directory, "the output's shard headers") from None
                raise OutputError(f"cannot create the output files in {directory}: {e}") from None
            raise
        hashers = min(len(files), HASHING_THREADS)
        self._threads = [
            threading.Thread(target=self._guard, args=(self._write_loop,), daemon=True),
            *(
                threading.Thread(target=self._guard, args=(self._hash_loop,), daemon=True)
                for _ in range(hashers)
            ),
        ]
        for thread in self._threads:
            thread.start()

    # -- producer side -------------------------------------------------------------------
    def put_copy(self, file: int, offset: int, src: int, src_offset: int, length: int) -> None:
        """Queue a file-to-file copy of `length` bytes to `offset` of output `file`."""
        with self._state:
            self._raise_if_failed()
            for start in range(0, length, COPY_PIECE):
                piece = min(COPY_PIECE, length - start)
                last = start + piece >= length
                self._copies.append(
                    _Copy(file, offset + start, src, src_offset + start, piece, last)
                )
            self._state.notify_all()

    def put_bytes(self, file: int, offset: int, data: memoryview, *, ends_tensor: bool) -> None:
        """Queue computed bytes; blocks while too many are waiting to be written."""
        with self._state:
            self._state.wait_for(
                lambda: self._error is not None or self._buffered < self._max_buffered
            )
            self._raise_if_failed()
            self._chunks.append(_Bytes(file, offset, data, ends_tensor))
            self._buffered += len(data)
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
        except BaseException as e:  # surfaced to the producer by _raise_if_failed
            with self._state:
                if self._error is None:
                    self._error = e
                self._state.notify_all()

    def _next_item(self) -> _Copy | _Bytes | None:
        """Computed chunks first (they hold memory and unblock the producer), then copies."""
        with self._state:
            self._state.wait_for(
                lambda: self._error is not None or self._chunks or self._copies or self._closed
            )
            if self._error is not None:
                return None
            if self._chunks:
                return self._chunks.popleft()
            if self._copies:
                return self._copies.popleft()
            return None

    def _write_loop(self) -> None:
        try:
            self._write_items()
        finally:
            with self._state:
                self._writer_done = True
                self._state.notify_all()

    def _write_items(self) -> None:
        while (item := self._next_item()) is not None:
            out = self._files[item.file]
            if isinstance(item, _Bytes):
                _pwrite_all(out.fd, item.data, item.offset)
                length = len(item.data)
            else:
                self._copy(item, out.fd)
                length = item.length
            if self.durable:
                out.unflushed += length
                if out.unflushed >= WRITEBACK_BYTES:
                    start_writeback(out.fd)
                    out.unflushed = 0
            with self._state:
                if isinstance(item, _Bytes):
                    self._buffered -= length
                if length:
                    out.done[item.offset] = item.offset + length
                self.bytes_written += length
                self.tensors_written += item.ends_tensor
                self._state.notify_all()
        if self.durable and self._error is None:
            for out in self._files:
                os.fdatasync(out.fd)

    def _copy(self, item: _Copy, fd: int) -> None:
        """In the kernel (copy_file_range, as cp does: no user-space copy) where the file
        system allows it, else through a reused user-space buffer."""
        src_offset, offset, length = item.src_offset, item.offset, item.length
        while length and self._copy_in_kernel:
            try:
                n = os.copy_file_range(item.src, fd, length, src_offset, offset)
            except OSError as e:
                if e.errno not in _NO_COPY_RANGE:
                    raise
                self._copy_in_kernel = False
                break
            if n == 0:
                raise OutputError("input ended while copying (file truncated?)")
            src_offset, offset, length = src_offset + n, offset + n, length - n
        view = memoryview(self._copy_buffer)
        while length:
            n = os.preadv(item.src, [view[: min(BLOCK, length)]], src_offset)
            if n == 0:
                raise OutputError("input ended while copying (file truncated?)")
            _pwrite_all(fd, view[:n], offset)
            src_offset, offset, length = src_offset + n, offset + n, length - n

    def _hash_loop(self) -> None:
        """Hash whole files, taking the next one not yet taken: the files' sha256s, each
        inherently serial, are computed side by side."""
        buffer: bytearray | None = None  # made if the file system refuses memory maps
        while True:
            with self._state:
                if self._next_to_hash >= len(self._files):
                    return
                out = self._files[self._next_to_hash]
                self._next_to_hash += 1
            sha = hashlib.sha256()
            while out.hashed < out.size:
                end = self._next_range(out)
                if end is None:
                    return
                while out.hashed < end and self._hash_through_map:
                    try:
                        out.hashed = _hash_mapped(sha, out.fd, out.hashed, end)
                    except OSError:  # e.g. ENODEV: a file system that cannot map files
                        self._hash_through_map = False
                while out.hashed < end:
                    buffer = buffer or bytearray(BLOCK)
                    view = memoryview(buffer)[: min(BLOCK, end - out.hashed)]
                    n = os.preadv(out.fd, [view], out.hashed)
                    if n == 0:
                        raise OutputError(f"{out.name} is shorter than what was written")
                    sha.update(view[:n])
                    out.hashed += n
            self.digests[out.name] = sha.hexdigest()

    def _next_range(self, out: _File) -> int | None:
        """Wait until the range starting where hashing stopped is written; return its end."""
        with self._state:
            self._state.wait_for(
                lambda: self._error is not None or out.hashed in out.done or self._writer_done
            )
            if self._error is not None or out.hashed not in out.done:
                if self._error is None:
                    self._error = OutputError(f"{out.name}: bytes at {out.hashed} never written")
                return None
            return out.done.pop(out.hashed)

    def _close(self) -> None:
        for out in self._files:
            if out.fd >= 0:
                os.close(out.fd)
                out.fd = -1


_SYNC_FILE_RANGE = libc.function(
    "sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Have the kernel start writing the file's dirty pages now (without waiting for them), so
    that the final fdatasync of a durable output finds little left to write: the disk works
    while the merge goes on instead of after it. Best effort."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _hash_mapped(sha: hashlib._Hash, fd: int, start: int, end: int) -> int:
    """Hash up to a block of the file from `start` (before `end`) through a memory map of the
    page cache, saving the copy into a buffer that a read makes (a tenth of the hashing
    thread's time); return where it stopped. Only bytes already written are mapped, and the
    file is ours, so no access can fall beyond its end."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    stop = min(end, base + BLOCK)
    with (
        mmap.mmap(fd, stop - base, prot=mmap.PROT_READ, offset=base) as window,
        memoryview(window) as view,
    ):
        sha.update(view[start - base :])
    return stop


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
