"""Tracebacks bounded for the log. An unexpected error in one request is logged with its
traceback, and a request can make that traceback as large as it likes: a recursion thousands of
frames deep (a deeply nested document), or a message that quotes the input. Here each
exception keeps its outermost and innermost frames (where it entered our code and where it
failed) and its lines are cut short, so one error adds kilobytes to the log at most."""

from __future__ import annotations

import traceback
from typing import Any

import uvicorn.logging

# Of each exception's stack: the outermost (the web stack, then the handler: ~30 deep) and the
# innermost frames. A usual traceback is kept whole.
OUTER_FRAMES = 30
INNER_FRAMES = 15
LINE_CHARS = 500
TOTAL_CHARS = 32 * 1024


def bounded_traceback(error: BaseException) -> str:
    """`traceback.format_exception(error)`, bounded as above (no trailing newline)."""
    shown = traceback.TracebackException.from_exception(error)
    for part in _parts(shown):
        left_out = len(part.stack) - OUTER_FRAMES - INNER_FRAMES
        if left_out > 0:
            del part.stack[OUTER_FRAMES:-INNER_FRAMES]
            part.__notes__ = [*(part.__notes__ or []), f"({left_out} frames left out)"]
    lines = [_cut(line, LINE_CHARS) for line in "".join(shown.format()).splitlines()]
    return _cut("\n".join(lines), TOTAL_CHARS)


def _parts(shown: traceback.TracebackException) -> list[traceback.TracebackException]:
    """The exception and every one chained to it (cause, context, members of a group)."""
    found: list[traceback.TracebackException] = []
    waiting = [shown]
    while waiting:
        part = waiting.pop()
        if any(part is seen for seen in found):
            continue
        found.append(part)
        waiting.extend(p for p in (part.__cause__, part.__context__) if p is not None)
        waiting.extend(part.exceptions or [])
    return found


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more)"


class BoundedFormatter(uvicorn.logging.DefaultFormatter):
    """uvicorn's, with each traceback bounded (above): uvicorn logs once more
    every error the app answered 500, and one request must not add megabytes to the log. Here,
    not beside `layerswap serve`: each process of `--workers` imports it to configure logging,
    and this module imports nothing heavy."""

    def formatException(self, ei: Any) -> str:
        error = ei[1]
        return bounded_traceback(error) if error is not None else super().formatException(ei)
