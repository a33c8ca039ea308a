"""Defensive parsing of the safetensors header (no tensor bytes are read here).

Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data region.
Every field is checked so that a malformed file is an error naming the file, never a crash,
a hang or a huge allocation.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, quoted
from engine.io.file_access import Opener, open_file
from engine.limits import MAX_RANK

# Same limit as the reference implementation: nobody needs a 100 MB header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# torch and the reference implementation size tensors in signed / unsigned 64-bit integers.
MAX_TENSOR_BYTES = 2**63 - 1

# safetensors dtype -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# The order the safetensors library lays a file's tensors out in, whoever calls its save_file
# (mergekit, transformers): by dtype in this order (the larger alignment first), then by name.
SAVE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
              "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")  # fmt: skip
_SAVE_RANK = {dtype: rank for rank, dtype in enumerate(SAVE_ORDER)}

# Names accepted for the recipe's output dtype, mapped to safetensors names.
OUTPUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live; `start` is an absolute offset in `file`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


def read_header(
    path: Path, opener: Opener = open_file
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors file's header: (tensors by name, metadata), the file
    opened by `opener` (engine/io/file_access.py)."""
    size, header_len, raw = _read_raw_header(path, opener)
    header = _parse_json(path, raw)
    metadata = _metadata(path, header.pop("__metadata__", None))
    data_start = 8 + header_len
    tensors = {name: _tensor(path, name, e, data_start) for name, e in header.items()}
    _check_bounds(path, tensors, size - data_start, data_start)
    return tensors, metadata


def _read_raw_header(path: Path, opener: Opener) -> tuple[int, int, bytes]:
    """(file size, header length, header bytes), the length checked against the file."""
    try:
        with os.fdopen(opener(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size  # of the file opened, whatever its name is now
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError.at(path, f"truncated: {size} bytes, too short for a header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError.at(
                    path, f"header length {header_len} exceeds {MAX_HEADER_BYTES} bytes"
                )
            if 8 + header_len > size:
                raise CheckpointError.at(
                    path, f"truncated: header claims {header_len} bytes, file has {size}"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError.at(path, f"cannot read: {e.strerror or e}") from None
    if len(raw) != header_len:  # the file shrank between the size check and the read
        raise CheckpointError.at(path, f"truncated: header claims {header_len} bytes")
    return size, header_len, raw


def _parse_json(path: Path, raw: bytes) -> dict[str, Any]:
    """The header as a JSON object. Stricter than Python's json: a repeated key would make
    readers disagree on which entry counts, and NaN/Infinity are not JSON."""
    try:
        header = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant
        )
    except RecursionError:
        raise CheckpointError.at(path, "header JSON nested too deeply") from None
    except _DuplicateKeyError as e:
        raise CheckpointError.at(path, f"header repeats the key {quoted(e.key)}") from None
    # ValueError also covers integers too long for Python to convert (its digit limit).
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError.at(path, f"header is not valid JSON ({quoted(str(e))})") from None
    if not isinstance(header, dict):
        raise CheckpointError.at(path, "header is not a JSON object")
    return header


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _metadata(path: Path, raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        _is_text(k) and isinstance(v, str) and _is_text(v) for k, v in raw.items()
    ):
        raise CheckpointError.at(path, "__metadata__ must map strings to strings")
    return raw


def _tensor(path: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    if not name or not _is_text(name):
        raise CheckpointError.at(path, f"tensor name {quoted(name)} is empty or not valid text")
    where = f"tensor {quoted(name)}"
    if not isinstance(entry, dict):
        raise CheckpointError.at(path, f"{where}: entry is not an object")
    dtype = _dtype(path, where, entry.get("dtype"))
    shape = _shape(path, where, entry.get("shape"))
    begin, end = _offsets(path, where, entry.get("data_offsets"))
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise CheckpointError.at(
            path,
            f"{where}: {end - begin} bytes in data_offsets but shape {quoted(list(shape))} "
            f"needs {expected}",
        )
    # An empty tensor's other dimensions still reach the output header and torch, whose sizes
    # are signed 64-bit: a shape must fit there even with its zero dimensions left out.
    if math.prod(d for d in shape if d) * DTYPE_SIZES[dtype] > MAX_TENSOR_BYTES:
        raise CheckpointError.at(path, f"{where}: shape {quoted(list(shape))} is too large")
    return TensorInfo(name, dtype, shape, path, data_start + begin, expected)


def _dtype(path: Path, where: str, dtype: Any) -> str:
    # Checked as a string first: a list or object is not hashable, so not a dictionary key.
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CheckpointError.at(path, f"{where}: unknown dtype {quoted(dtype)}")
    return dtype


def _shape(path: Path, where: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError.at(path, f"{where}: shape must be a list of non-negative ints")
    if len(shape) > MAX_RANK:
        raise CheckpointError.at(path, f"{where}: {len(shape)} dimensions; at most {MAX_RANK}")
    return tuple(shape)


def _offsets(path: Path, where: str, offsets: Any) -> tuple[int, int]:
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError.at(path, f"{where}: data_offsets must be [begin, end], begin <= end")
    return offsets[0], offsets[1]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_text(value: str) -> bool:
    """JSON escapes can spell lone surrogates, which no file, log or database can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_bounds(
    path: Path, tensors: dict[str, TensorInfo], data_size: int, data_start: int
) -> None:
    end = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.nbytes)):
        if info.start < end:
            raise CheckpointError.at(path, f"tensor {quoted(info.name)} overlaps another tensor")
        end = info.start + info.nbytes
    if end - data_start > data_size:
        raise CheckpointError.at(
            path,
            f"truncated: tensors need {end - data_start} data bytes, file has {data_size}",
        )


def save_order(dtype: str, name: str) -> tuple[int, str]:
    """A tensor's place in a file as save_file lays it out (SAVE_ORDER; names compared as
    their UTF-8 bytes are, code point by code point)."""
    return _SAVE_RANK[dtype], name


def encode_header(entries: dict[str, dict[str, Any]], metadata: dict[str, str]) -> bytes:
    """Serialise a header (length prefix included), padded so tensor data is 8-byte aligned:
    the entries in their order, names in UTF-8 unescaped, as the safetensors library writes."""
    header = {"__metadata__": metadata, **entries}
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body
