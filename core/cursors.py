"""Cursors of the list routes: an opaque token for "after the row (created_at, id)", made and
read here only, for job and webhook lists alike.

A client may send anything as a cursor, so it is read by shape, never handed to a general
parser: at most MAX_CURSOR_CHARS of url-safe base64 whose bytes are exactly the pair that
encode_cursor writes. Anything else (nested JSON that would exhaust a parser's recursion, NUL
bytes a database refuses, another API's token) is a 422 naming `cursor`.
"""

from __future__ import annotations

import base64
import json
import re
from datetime import datetime

from core.errors import InvalidRequest

MAX_CURSOR_CHARS = 256  # encode_cursor's are about 100
ENCODED = re.compile(r"[A-Za-z0-9_-]+={0,2}")
# json.dumps([created_at.isoformat(), id]): a timestamp and an id, nothing nested, no escapes.
POSITION = re.compile(r'\["([0-9T:.+-]{10,40})", "([A-Za-z0-9_-]{1,64})"\]')


def encode_cursor(created_at: datetime, row_id: str) -> str:
    """A list's position after the row (created_at, id)."""
    raw = json.dumps([created_at.isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The (created_at, id) encode_cursor wrote; InvalidRequest for anything else."""
    if len(cursor) > MAX_CURSOR_CHARS or not ENCODED.fullmatch(cursor):
        raise _not_a_cursor()
    try:
        found = POSITION.fullmatch(base64.urlsafe_b64decode(cursor).decode("ascii"))
        if found is None:
            raise ValueError(cursor)
        return datetime.fromisoformat(found[1]), found[2]
    except ValueError as e:  # bad padding or alphabet, not ASCII, not a timestamp
        raise _not_a_cursor() from e


def _not_a_cursor() -> InvalidRequest:
    return InvalidRequest("cursor: not a cursor from this API", details={"field": "cursor"})
