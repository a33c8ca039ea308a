"""Opening an input checkpoint's files, confined where the caller says.

Used alone (the CLI), the engine reads what a checkpoint directory holds, symlinks followed: on
their own machine a user may link their own files. The service passes a FileGuard: each file is
checked after it is opened, by the path its descriptor really has (/proc/self/fd), so neither a
symlink nor one swapped in after an earlier check leads anywhere the guard refuses.

Files are opened non-blocking: a FIFO or device in a checkpoint is refused by its type instead of
blocking the open forever (regular files read as ever).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from engine.errors import CheckpointError

# (the checkpoint directory, the real path of a file opened from it) -> why that file may not
# be read (a phrase that follows its name), or None when it may.
FileGuard = Callable[[Path, Path], str | None]
# Opens one of a checkpoint's files read-only; the caller closes the descriptor.
Opener = Callable[[Path], int]

FLAGS = os.O_RDONLY | os.O_NONBLOCK
COPY_BLOCK = 1024 * 1024


def open_file(path: Path) -> int:
    """The engine's own opener: the file as named, symlinks followed."""
    return os.open(path, FLAGS)


def confined(directory: Path, guard: FileGuard) -> Opener:
    """An opener for `directory`'s files that refuses, with a CheckpointError naming the file,
    one whose real path `guard` refuses."""

    def opener(path: Path) -> int:
        fd = os.open(path, FLAGS)
        try:
            why = guard(directory, opened_path(fd, path))
        except BaseException:
            os.close(fd)
            raise
        if why is not None:
            os.close(fd)
            raise CheckpointError.at(path, why)
        return fd

    return opener


def opened_path(fd: int, path: Path) -> Path:
    """The real path of the file `fd` holds: from /proc where there is one (the file as opened,
    whatever its name points at by now), else `path` resolved."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return Path(os.path.realpath(path))


def read_file(path: Path, limit: int, opener: Opener = open_file) -> bytes:
    """A regular file's bytes; a CheckpointError naming it when it is not one or holds more than
    `limit` bytes. OSError (FileNotFoundError among them) is the caller's to name."""
    with os.fdopen(opener(path), "rb") as f:
        info = os.fstat(f.fileno())
        _check_regular(path, info, limit)
        # Read what the file holds plus one byte to see it grew: a read of `limit + 1` would
        # reserve the whole limit up front (64 MB for a 1 KB config).
        data = f.read(info.st_size + 1)
        if len(data) > info.st_size:
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:  # it grew since the check
        raise CheckpointError.at(path, f"more than {limit} bytes")
    return data


def copy_file(source: Path, target: Path, limit: int, opener: Opener = open_file) -> None:
    """Copy a regular file of at most `limit` bytes, read through `opener`, to `target`."""
    with os.fdopen(opener(source), "rb") as f:
        _check_regular(source, os.fstat(f.fileno()), limit)
        with open(target, "wb") as out:
            shutil.copyfileobj(f, out, COPY_BLOCK)


def _check_regular(path: Path, info: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(info.st_mode):  # a FIFO or device would block a read forever
        raise CheckpointError.at(path, "not a regular file")
    if info.st_size > limit:
        raise CheckpointError.at(path, f"{info.st_size} bytes; at most {limit}")
