"""Malformed safetensors headers (and config/index JSON): refused by name, never a crash.

A property test mutates a valid header in every way a broken or hostile writer could (values
replaced by arbitrary JSON, keys dropped, added or repeated, offsets and shapes shifted, the
length prefix and the data region off, bytes corrupted), writes each result to a real
checkpoint directory and opens it. Two outcomes are allowed: the checkpoint opens, and then
every tensor reads back exactly the bytes its header points at; or a CheckpointError names the
file (or, for whole-checkpoint problems, the directory) in one short line. Explicit cases pin
the crashes the property test found.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import CheckpointError
from engine.io.checkpoint import Checkpoint
from engine.io.safetensors_format import DTYPE_SIZES
from tests.conftest import Family
from tests.helpers import leftovers, write_recipe
from tests.test_cli import layerswap

# Reproducible in CI: the same examples on every run, nothing carried over between runs.
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_MESSAGE = 1000  # an error message quotes header values only in short


@dataclass(frozen=True)
class Raw:
    """JSON text written verbatim: what json.dumps cannot produce (huge ints, bad escapes)."""

    text: str


@dataclass
class Obj:
    """A JSON object as ordered pairs, so that a key can appear twice."""

    pairs: list[tuple[str, Any]]


def dump(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return dump(Obj(list(value.items())))
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def entry(dtype: Any, shape: Any, offsets: Any) -> Obj:
    return Obj([("dtype", dtype), ("shape", shape), ("data_offsets", offsets)])


def valid_header() -> Obj:
    """Four tensors (one empty, one a layer) back to back in 38 data bytes, plus metadata."""
    return Obj(
        [
            ("__metadata__", Obj([("format", "pt")])),
            ("model.embed_tokens.weight", entry("BF16", [4, 2], [0, 16])),
            ("model.layers.0.mlp.up_proj.weight", entry("F32", [2, 2], [16, 32])),
            ("model.norm.weight", entry("F16", [3], [32, 38])),
            ("model.empty", entry("I64", [0, 5], [38, 38])),
        ]
    )


DATA = bytes(range(38))
CONFIG = {"model_type": "llama", "num_hidden_layers": 1}

# -- strategies -------------------------------------------------------------------------------
ODD_TOKENS = st.sampled_from(
    [Raw(t) for t in ("NaN", "-Infinity", "1e999", "-0", "1.0", "1E2", '"\\ud800"', "9" * 5000)]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-50, max_value=50)
    | st.sampled_from([2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 2**64 + 8, 10**30])
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from([*DTYPE_SIZES, "f32", "", "__metadata__"])
    | ODD_TOKENS
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.builds(Obj, st.lists(st.tuples(st.text(max_size=4), inner), max_size=3))
    ),
    max_leaves=4,
)
KEYS = st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__", "format", ""]) | st.text(
    max_size=8
)


def pick(draw: Any, obj: Obj) -> int | None:
    return draw(st.integers(0, len(obj.pairs) - 1)) if obj.pairs else None


def entries(obj: Obj) -> list[Obj]:
    return [v for _, v in obj.pairs if isinstance(v, Obj)]


def replace_value(draw: Any, header: Obj) -> None:
    """Some value (a whole entry, or one field of an entry or of the metadata) becomes any JSON."""
    target = draw(st.sampled_from([header, *entries(header)]))
    if (i := pick(draw, target)) is not None:
        target.pairs[i] = (target.pairs[i][0], draw(JSON_VALUES))


def remove_key(draw: Any, header: Obj) -> None:
    target = draw(st.sampled_from([header, *entries(header)]))
    if (i := pick(draw, target)) is not None:
        del target.pairs[i]


def add_key(draw: Any, header: Obj) -> None:
    """A new key (maybe one already there): arbitrary JSON, or an entry that looks plausible."""
    target = draw(st.sampled_from([header, *entries(header)]))
    value = draw(
        JSON_VALUES
        | st.builds(
            entry,
            st.sampled_from(list(DTYPE_SIZES)),
            st.lists(st.integers(0, 6), max_size=3),
            st.lists(st.integers(0, 60), min_size=2, max_size=2),
        )
    )
    key = draw(KEYS | st.sampled_from([k for k, _ in target.pairs] or ["x"]))
    target.pairs.insert(draw(st.integers(0, len(target.pairs))), (key, value))


def shift_numbers(draw: Any, header: Obj) -> None:
    """An offset or a dimension moves by a little, or becomes huge."""
    fields = [
        (e, i)
        for e in entries(header)
        for i, (k, v) in enumerate(e.pairs)
        if k in ("shape", "data_offsets") and isinstance(v, list) and v
    ]
    if not fields:
        return
    target, i = draw(st.sampled_from(fields))
    key, numbers = target.pairs[i]
    numbers = list(numbers)
    j = draw(st.integers(0, len(numbers) - 1))
    if isinstance(numbers[j], int):
        delta = draw(st.integers(-40, 40) | st.sampled_from([2**62, 2**64, -(2**63)]))
        numbers[j] = numbers[j] + delta
    if draw(st.booleans()):
        numbers.append(draw(st.integers(0, 40)))
    target.pairs[i] = (key, numbers)


def rename(draw: Any, header: Obj) -> None:
    """A tensor (or the metadata) gets another name, maybe one already taken."""
    if (i := pick(draw, header)) is not None:
        names = [k for k, _ in header.pairs]
        header.pairs[i] = (draw(KEYS | st.sampled_from(names)), header.pairs[i][1])


def relocate(draw: Any, header: Obj) -> None:
    """A tensor's bytes move elsewhere, keeping their length: into a gap, onto another tensor
    or past the end of the data."""
    spans = [
        (e, i, v)
        for e in entries(header)
        for i, (k, v) in enumerate(e.pairs)
        if k == "data_offsets" and isinstance(v, list) and len(v) == 2
    ]
    if spans and all(isinstance(n, int) for _, _, v in spans for n in v):
        target, i, (begin, end) = draw(st.sampled_from(spans))
        start = draw(st.integers(0, 64))
        target.pairs[i] = ("data_offsets", [start, start + end - begin])


def reorder(draw: Any, header: Obj) -> None:
    header.pairs = draw(st.permutations(header.pairs))


MUTATIONS = (replace_value, remove_key, add_key, shift_numbers, rename, relocate, reorder)


@st.composite
def mutated_files(draw: Any) -> bytes:
    """A once-valid safetensors file after 1-4 header mutations and maybe a bad frame."""
    header = valid_header()
    for _ in range(draw(st.integers(1, 4))):
        draw(st.sampled_from(MUTATIONS))(draw, header)
    body = dump(header).encode("utf-8")
    body += b" " * (-len(body) % 8)
    length = len(body)
    if draw(st.integers(0, 4)) == 0:
        length = draw(st.integers(0, 2**64 - 1) | st.integers(length - 16, length + 16))
    data = DATA + bytes(draw(st.integers(0, 40)))
    if draw(st.integers(0, 4)) == 0:
        data = data[: draw(st.integers(0, len(data)))]
    return struct.pack("<Q", max(length, 0)) + body + data


@st.composite
def corrupted_files(draw: Any) -> bytes:
    """A valid file with 1-3 bytes of its header replaced (invalid UTF-8 included)."""
    body = dump(valid_header()).encode("utf-8")
    body += b" " * (-len(body) % 8)
    content = bytearray(struct.pack("<Q", len(body)) + body + DATA)
    for _ in range(draw(st.integers(1, 3))):
        content[draw(st.integers(0, 8 + len(body) - 1))] = draw(st.integers(0, 255))
    return bytes(content)


# -- the property -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fuzzed")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def open_and_check(directory: Path, content: bytes) -> None:
    """Success with every tensor readable exactly where its header points, or a named error."""
    weights = directory / "model.safetensors"
    weights.write_bytes(content)
    try:
        checkpoint = Checkpoint.open(directory)
    except CheckpointError as e:
        assert e.details["path"] in (str(weights), str(directory)), e.message
        assert e.message.startswith(e.details["path"] + ": "), e.message
        assert "\n" not in e.message and len(e.message) < MAX_MESSAGE, e.message
        return
    try:
        for info in checkpoint.tensors.values():
            assert info.dtype in DTYPE_SIZES
            assert info.nbytes == info.numel * DTYPE_SIZES[info.dtype]
            assert info.start >= 8 and info.start + info.nbytes <= len(content)
            buffer = bytearray(info.nbytes)
            checkpoint.read_into(info, memoryview(buffer))
            assert bytes(buffer) == content[info.start : info.start + info.nbytes]
    finally:
        checkpoint.close()


def test_the_unmutated_header_opens(checkpoint_dir: Path) -> None:
    body = dump(valid_header()).encode()
    open_and_check(checkpoint_dir, struct.pack("<Q", len(body)) + body + DATA)
    checkpoint = Checkpoint.open(checkpoint_dir)
    assert len(checkpoint.tensors) == 4
    checkpoint.close()


@settings(FUZZ, max_examples=1500)
@given(content=mutated_files())
def test_mutated_headers_open_or_are_refused_by_name(checkpoint_dir: Path, content: bytes) -> None:
    open_and_check(checkpoint_dir, content)


@settings(FUZZ, max_examples=500)
@given(content=corrupted_files())
def test_corrupted_header_bytes_open_or_are_refused_by_name(
    checkpoint_dir: Path, content: bytes
) -> None:
    open_and_check(checkpoint_dir, content)


# -- regressions ------------------------------------------------------------------------------
def craft(header_json: str, data: bytes = DATA) -> bytes:
    body = header_json.encode("utf-8")
    return struct.pack("<Q", len(body)) + body + data


def one(entry_json: str, name: str = '"w"') -> str:
    return "{" + f"{name}:{entry_json}" + "}"


REFUSED: dict[str, tuple[str, str]] = {
    "dtype-list": (one('{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}'), "unknown dtype"),
    "dtype-object": (
        one('{"dtype":{"F32":1},"shape":[2],"data_offsets":[0,8]}'),
        "unknown dtype",
    ),
    "repeated-tensor": (
        '{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
        "repeats the key 'w'",
    ),
    "repeated-field": (
        one('{"dtype":"U8","dtype":"F64","shape":[1],"data_offsets":[0,1]}'),
        "repeats the key 'dtype'",
    ),
    "nan-dimension": (one('{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}'), "not valid JSON"),
    "infinite-offset": (
        one('{"dtype":"U8","shape":[1],"data_offsets":[0,Infinity]}'),
        "not valid JSON",
    ),
    "5000-digit-offset": (
        one('{"dtype":"U8","shape":[1],"data_offsets":[0,' + "9" * 5000 + "]}"),
        "not valid JSON",
    ),
    "float-offset": (one('{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}'), "data_offsets"),
    "bool-offset": (one('{"dtype":"U8","shape":[1],"data_offsets":[false,true]}'), "data_offsets"),
    "empty-tensor-with-huge-dimension": (
        one('{"dtype":"F32","shape":[0,' + str(2**70) + '],"data_offsets":[0,0]}'),
        "too large",
    ),
    "lone-surrogate-name": (
        one('{"dtype":"U8","shape":[1],"data_offsets":[0,1]}', name='"\\ud800"'),
        "not valid text",
    ),
    "empty-name": (one('{"dtype":"U8","shape":[1],"data_offsets":[0,1]}', name='""'), "empty"),
    "metadata-value-list": ('{"__metadata__":{"format":["pt"]}}', "__metadata__"),
    "metadata-lone-surrogate": ('{"__metadata__":{"format":"\\udfff"}}', "__metadata__"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_malformed_header_regressions(case: str, checkpoint_dir: Path) -> None:
    header_json, expected = REFUSED[case]
    weights = checkpoint_dir / "model.safetensors"
    weights.write_bytes(craft(header_json))
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(checkpoint_dir)
    assert info.value.details["path"] == str(weights)
    assert expected in info.value.message
    assert len(info.value.message) < MAX_MESSAGE


def test_a_huge_value_is_quoted_short(checkpoint_dir: Path) -> None:
    huge = "F" * 1_000_000
    weights = checkpoint_dir / "model.safetensors"
    weights.write_bytes(craft(one(f'{{"dtype":"{huge}","shape":[1],"data_offsets":[0,1]}}')))
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(checkpoint_dir)
    assert "unknown dtype 'FFFF" in info.value.message
    assert len(info.value.message) < MAX_MESSAGE


# -- config.json and the shard index ----------------------------------------------------------
def good_weights(directory: Path) -> None:
    (directory / "model.safetensors").write_bytes(
        craft(one('{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'))
    )


@pytest.mark.parametrize(
    "config",
    [
        '{"num_hidden_layers": ' + "1" * 5000 + "}",
        '{"num_hidden_layers": 1.0}',
        '{"num_hidden_layers": [1]}',
        '{"num_hidden_layers": {"n": 1}}',
        '{"num_hidden_layers": true}',
        '{"text_config": [1], "num_hidden_layers": "1"}',
    ],
    ids=["5000-digits", "float", "list", "object", "bool", "string"],
)
def test_config_type_confusion_is_refused(config: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(config)
    good_weights(tmp_path)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.details["path"] == str(tmp_path / "config.json")
    assert len(info.value.message) < MAX_MESSAGE


def test_a_config_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.json")
    good_weights(tmp_path)
    with pytest.raises(CheckpointError, match="not a regular file") as info:
        Checkpoint.open(tmp_path)
    assert info.value.details["path"] == str(tmp_path / "config.json")


@pytest.mark.parametrize(
    "index",
    [
        {"weight_map": {"w": ["model.safetensors"]}},
        {"weight_map": {"w": {"file": "model.safetensors"}}},
        {"weight_map": [["w", "model.safetensors"]]},
        {"weight_map": {"w": "model.safetensors\u0000.safetensors"}},
        ["weight_map"],
        Raw('{"weight_map": {"w": 1' + "0" * 5000 + "}}"),
    ],
    ids=["list-file", "object-file", "list-map", "nul-in-name", "not-object", "5000-digits"],
)
def test_index_type_confusion_is_refused(index: Any, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    good_weights(tmp_path)
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(dump(index))
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.details["path"].startswith(str(tmp_path))
    assert len(info.value.message) < MAX_MESSAGE


def test_the_cli_refuses_a_list_dtype_in_one_line(llama: Family, tmp_path: Path) -> None:
    bad = shutil.copytree(llama.language, tmp_path / "bad")
    weights = bad / "model.safetensors"
    weights.write_bytes(craft(REFUSED["dtype-list"][0]))
    recipe = write_recipe(tmp_path / "soup.yaml", {"method": "soup", "models": [llama.task, bad]})
    out = tmp_path / "merged"
    proc = layerswap("merge", recipe, "--out", out, "-q", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback
    assert lines[0].startswith("layerswap: error [invalid_checkpoint]")
    assert f"{weights}: tensor 'w': unknown dtype ['F32']" in lines[0]
    assert leftovers(out) == []
