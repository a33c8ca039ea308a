"""What no handler is shown: query strings and JSON bodies that a database could not store, or
that a parser could not read without exhausting its recursion. Pure functions of the bytes;
service/api/middleware.py answers what they find as a 422 naming the field.

PostgreSQL's text holds no NUL character, and no encoding holds a lone UTF-16 surrogate (JSON's
`"\\ud800"`): PostgreSQL would refuse the first in a query (a 500) where SQLite quietly matches
nothing, and both fail on the second. So both are refused everywhere, the same on every store.
A JSON body nests arrays and objects at most `max_json_depth` deep, measured on its bytes
before anything parses them; its numbers are finite (no NaN or Infinity, none so large that
it reads as infinite), and its text is UTF-8 (RFC 8259), the only encoding the depth is
measured in.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any
from urllib.parse import parse_qsl

Refusal = tuple[str, dict[str, Any]]  # the message, and the details naming the field

UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
STORED_NOWHERE = "holds a NUL character or a lone UTF-16 surrogate, which no stored text can"
STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
STEP = tuple(1 if byte in b"[{" else -1 if byte in b"]}" else 0 for byte in range(256))
# What only reading the JSON can judge: a NUL or a surrogate, escaped or (a surrogate: JSON's
# parser lets it through) in raw UTF-8, and numbers that may not be finite (NaN, Infinity, an
# exponent of three digits, 309 digits in a row). A body with none of them (nearly all) is not
# read here. Each search is linear in the body: a run of digits is tried from its start only.
SUSPECT = (
    re.compile(rb"\\u(?:0000|[dD][89a-fA-F])|\xed[\xa0-\xbf]"),
    re.compile(rb"NaN|Infinity"),
    re.compile(rb"[eE]\+?[0-9]{3}"),
    re.compile(rb"(?<![0-9])[0-9]{309}"),
)
FIELD_CHARS = 100  # of a refused name, shown in the answer


def query_refusal(query_string: bytes) -> Refusal | None:
    """The first query parameter whose name or value holds a NUL (the only unstorable
    character a query can carry: percent-escapes are read as UTF-8, bad bytes replaced)."""
    if b"%00" not in query_string and b"\x00" not in query_string:
        return None
    for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            field = shown(name)
            return f"{field}: {STORED_NOWHERE}", {"field": field, "in": "query"}
    return None


def body_refusal(body: bytes, max_depth: int) -> Refusal | None:
    """Why a JSON body is refused unread, or None. One that is not JSON at all is left to the
    parser, which says so in its own words."""
    if json.detect_encoding(body) not in ("utf-8", "utf-8-sig"):
        return "body: JSON must be sent as UTF-8", {"field": "body"}
    if too_deep(body, max_depth):
        message = f"body: nested deeper than {max_depth} arrays and objects"
        return message, {"field": "body", "limit": max_depth}
    if not any(pattern.search(body) for pattern in SUSPECT):
        return None
    try:
        parsed = json.loads(body, parse_constant=NotFinite, parse_float=finite)
    except ValueError:
        return None
    return unstorable_in(parsed, ())


def too_deep(body: bytes, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` outside the body's strings."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = STRINGS.sub(b"", body).translate(None, NOT_BRACKETS)
    return max(accumulate(map(STEP.__getitem__, brackets)), default=0) > limit


class NotFinite(str):
    """A number that is not finite, as the body wrote it: refused where it stands."""


def finite(text: str) -> float | NotFinite:
    """JSON's parse of a number with a fraction or an exponent; NotFinite when it is too large
    to be finite (1e999)."""
    value = float(text)
    return value if math.isfinite(value) else NotFinite(text)


def unstorable_in(value: Any, path: tuple[str, ...]) -> Refusal | None:
    """The first string, key or number of a parsed body that cannot be stored, named by its
    dotted path (as validation errors name fields). Recursion is bounded by the depth limit."""
    if isinstance(value, NotFinite):
        return _named(path, f"{shown(value)} is not a finite number")
    if isinstance(value, str):
        return _named(path, STORED_NOWHERE) if UNSTORABLE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if UNSTORABLE.search(key):
                return _named((*path, shown(key)), STORED_NOWHERE)
            found = unstorable_in(item, (*path, shown(key)))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = unstorable_in(item, (*path, str(index)))
            if found is not None:
                return found
    return None


def _named(path: tuple[str, ...], problem: str) -> Refusal:
    field = ".".join(path) or "body"
    return f"{field}: {problem}", {"field": field}


def shown(name: str) -> str:
    """A client's name as an answer may quote it: cut short, control and non-ASCII characters
    escaped (a NUL reads as `\\x00`)."""
    return name[:FIELD_CHARS].encode("unicode_escape").decode("ascii")
