"""Sequential output files, written on one thread and sha256-hashed on another.

The producer (the merge loop) queues whole-file commands: begin, bytes, copy, end. Copies
go file-to-file with copy_file_range (no user-space buffer); the hasher then reads the
copied range back from the output file's page cache, so the digest is of the bytes that
were actually written. Queues are bounded, so memory is bounded by depth × chunk size.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.engine.errors import OutputError

BLOCK = 8 * 1024 * 1024
COPY_PIECE = 64 * 1024 * 1024
_FALLBACK_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


class OutputWriter:
    def __init__(self, directory: Path, *, depth: int = 3, durable: bool = True) -> None:
        self.directory = directory
        self.durable = durable
        self.digests: dict[str, str] = {}
        self.bytes_hashed = 0
        self._error: BaseException | None = None
        self._writes: queue.Queue[tuple[Any, ...] | None] = queue.Queue(depth)
        self._hashes: queue.Queue[tuple[Any, ...] | None] = queue.Queue(depth)
        self._use_copy_range = hasattr(os, "copy_file_range")
        self._threads = [
            threading.Thread(target=self._run, args=(self._writes, self._write), daemon=True),
            threading.Thread(target=self._run, args=(self._hashes, self._hash), daemon=True),
        ]
        self._fd = -1
        self._read_fd = -1
        self._sha: Any = None
        self._hashing = ""
        for thread in self._threads:
            thread.start()

    # -- producer side -------------------------------------------------------------------
    def begin_file(self, name: str, header: bytes) -> None:
        self._put(("begin", name))
        self.put_bytes(header)

    def put_bytes(self, data: bytes | memoryview) -> None:
        self._put(("bytes", data))

    def put_copy(self, fd: int, offset: int, length: int) -> None:
        for start in range(0, length, COPY_PIECE):
            self._put(("copy", fd, offset + start, min(COPY_PIECE, length - start)))

    def end_file(self) -> None:
        self._put(("end",))

    def finish(self) -> dict[str, str]:
        """Wait for every queued write and hash; return sha256 by file name."""
        self._writes.put(None)
        for thread in self._threads:
            thread.join()
        self._raise_if_failed()
        return self.digests

    def abort(self) -> None:
        if self._error is None:
            self._error = OutputError("output aborted")
        self._writes.put(None)
        for thread in self._threads:
            thread.join()
        self._close_fds()

    def _put(self, item: tuple[Any, ...]) -> None:
        self._raise_if_failed()
        self._writes.put(item)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            if isinstance(self._error, OSError):
                raise OutputError(f"writing the output failed: {self._error}") from self._error
            raise self._error

    # -- threads ---------------------------------------------------------------------------
    def _run(
        self,
        inbox: queue.Queue[tuple[Any, ...] | None],
        handle: Callable[[tuple[Any, ...]], None],
    ) -> None:
        while (item := inbox.get()) is not None:
            if self._error is None:
                try:
                    handle(item)
                except BaseException as e:  # surfaced to the producer by _raise_if_failed
                    self._error = e
        if inbox is self._writes:
            self._hashes.put(None)

    def _write(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "begin":
            path = self.directory / item[1]
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._hashes.put(("begin", item[1], path))
        elif kind == "bytes":
            _write_all(self._fd, memoryview(item[1]))
            self._hashes.put(item)
        elif kind == "copy":
            position = os.lseek(self._fd, 0, os.SEEK_CUR)
            self._copy(item[1], item[2], item[3])
            self._hashes.put(("copied", position, item[3]))
        else:
            if self.durable:
                os.fdatasync(self._fd)
            os.close(self._fd)
            self._fd = -1
            self._hashes.put(item)

    def _copy(self, src: int, offset: int, length: int) -> None:
        while length and self._use_copy_range:
            try:
                n = os.copy_file_range(src, self._fd, length, offset)
            except OSError as e:
                if e.errno not in _FALLBACK_ERRNOS:
                    raise
                self._use_copy_range = False
                break
            if n == 0:
                raise OutputError("input ended while copying (file truncated?)")
            offset, length = offset + n, length - n
        buffer = bytearray(min(BLOCK, length))
        while length:
            view = memoryview(buffer)[: min(BLOCK, length)]
            n = os.preadv(src, [view], offset)
            if n == 0:
                raise OutputError("input ended while copying (file truncated?)")
            _write_all(self._fd, view[:n])
            offset, length = offset + n, length - n

    def _hash(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "begin":
            self._sha = hashlib.sha256()
            self._hashing = item[1]
            self._read_fd = os.open(item[2], os.O_RDONLY)
        elif kind == "bytes":
            self._sha.update(item[1])
            self.bytes_hashed += len(item[1])
        elif kind == "copied":
            self._hash_range(item[1], item[2])
        else:
            self.digests[self._hashing] = self._sha.hexdigest()
            os.close(self._read_fd)
            self._read_fd = -1

    def _hash_range(self, offset: int, length: int) -> None:
        buffer = bytearray(min(BLOCK, length))
        while length:
            view = memoryview(buffer)[: min(BLOCK, length)]
            n = os.preadv(self._read_fd, [view], offset)
            if n == 0:
                raise OutputError("output file shorter than what was written")
            self._sha.update(view[:n])
            self.bytes_hashed += n
            offset, length = offset + n, length - n

    def _close_fds(self) -> None:
        for fd in (self._fd, self._read_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._read_fd = -1


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        data = data[os.write(fd, data) :]
