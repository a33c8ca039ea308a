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
# A sorted list's: the sort, its key's text (base64, so any text), then the pair as above.
MAX_SORTED_CURSOR_CHARS = 2048
SORTED_POSITION = re.compile(
    r'\["([a-z_]{1,32})", "([A-Za-z0-9_=-]{0,1400})", '
    r'"([0-9T:.+-]{10,40})", "([A-Za-z0-9_-]{1,64})"\]'
)


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


def encode_sorted_cursor(sort: str, value: str, created_at: datetime, row_id: str) -> str:
    """A position in a list sorted by `sort`: after (or before) the row whose sort key is
    `value` (as text), ties broken by (created_at, id)."""
    text = base64.urlsafe_b64encode(value.encode()).decode()
    raw = json.dumps([sort, text, created_at.isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_sorted_cursor(cursor: str, sort: str) -> tuple[str, datetime, str]:
    """The (value, created_at, id) encode_sorted_cursor wrote for `sort`; InvalidRequest for
    anything else, a cursor of another sort included."""
    if len(cursor) > MAX_SORTED_CURSOR_CHARS or not ENCODED.fullmatch(cursor):
        raise _not_a_cursor()
    try:
        found = SORTED_POSITION.fullmatch(base64.urlsafe_b64decode(cursor).decode("ascii"))
        if found is None or found[1] != sort:
            raise ValueError(cursor)
        value = base64.urlsafe_b64decode(found[2]).decode()
        return value, datetime.fromisoformat(found[3]), found[4]
    except ValueError as e:  # as decode_cursor; UnicodeDecodeError is a ValueError
        raise _not_a_cursor() from e


def _not_a_cursor() -> InvalidRequest:
    return InvalidRequest("cursor: not a cursor from this API", details={"field": "cursor"})
