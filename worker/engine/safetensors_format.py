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

from worker.engine.errors import CheckpointError
from worker.engine.limits import MAX_RANK

# Same limit as the reference implementation: nobody needs a 100 MB header.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})

# Names accepted for the recipe's output dtype, mapped to safetensors names.
OUTPUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


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


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors file's header: (tensors by name, metadata)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
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
    try:
        header = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise CheckpointError.at(path, "header JSON nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError.at(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError.at(path, "header is not a JSON object")
    metadata = _metadata(path, header.pop("__metadata__", None))
    data_start = 8 + header_len
    tensors = {name: _tensor(path, name, e, data_start) for name, e in header.items()}
    _check_bounds(path, tensors, size - data_start, data_start)
    return tensors, metadata


def _metadata(path: Path, raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise CheckpointError.at(path, "__metadata__ must map strings to strings")
    return raw


def _tensor(path: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError.at(path, f"{where}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CheckpointError.at(path, f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError.at(path, f"{where}: shape must be a list of non-negative ints")
    if len(shape) > MAX_RANK:
        raise CheckpointError.at(path, f"{where}: {len(shape)} dimensions; at most {MAX_RANK}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError.at(path, f"{where}: data_offsets must be [begin, end], begin <= end")
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if nbytes != expected:
        raise CheckpointError.at(
            path, f"{where}: {nbytes} bytes in data_offsets but shape {shape} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offsets[0], nbytes)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_bounds(
    path: Path, tensors: dict[str, TensorInfo], data_size: int, data_start: int
) -> None:
    end = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.nbytes)):
        if info.start < end:
            raise CheckpointError.at(path, f"tensor {info.name!r} overlaps another tensor")
        end = info.start + info.nbytes
    if end - data_start > data_size:
        raise CheckpointError.at(
            path,
            f"truncated: tensors need {end - data_start} data bytes, file has {data_size}",
        )


def encode_header(entries: dict[str, dict[str, Any]], metadata: dict[str, str]) -> bytes:
    """Serialise a header (length prefix included), padded so tensor data is 8-byte aligned."""
    body = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body
