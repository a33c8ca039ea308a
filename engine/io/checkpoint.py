"""A Hugging Face checkpoint directory opened for streaming: configs and tensor locations.

Opening reads headers only. Tensor bytes are read later with positioned reads into caller
buffers (never mmap: mapped pages would count against the process's memory).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from engine.architectures import (
    LayerStack,
    Refusal,
    find_layer_stack,
    layer_count_problem,
    model_type_of,
)
from engine.errors import CheckpointError, quoted
from engine.io.file_access import FileGuard, Opener, confined, open_file, read_file
from engine.io.lora import LoraAdapter
from engine.io.safetensors_format import TensorInfo, read_header
from engine.limits import MAX_JSON_BYTES, MAX_TENSORS, MAX_WEIGHT_FILES

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
EXTRA_CONFIG_FILES = ("generation_config.json",)


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    weight_files: list[Path]
    # How its files are opened: as named, or confined by the caller's guard (file_access.py).
    opener: Opener = field(default=open_file, repr=False, compare=False)
    # A `model+adapter` source: the LoRA adapter its targeted weights are read through.
    adapter: LoraAdapter | None = field(default=None, repr=False, compare=False)
    _fds: dict[Path, int] = field(default_factory=dict, repr=False)

    @classmethod
    def open(
        cls, path: Path, guard: FileGuard | None = None, *, adapter: Path | None = None
    ) -> Checkpoint:
        """Open and validate a checkpoint directory (headers only). With `guard`, every file of
        it that is read is checked first, then and later (file_access.py). With `adapter`, a
        PEFT LoRA adapter's directory, the weights it targets read as it changes them."""
        if not path.is_dir():
            raise CheckpointError.at(path, "not a checkpoint directory (does not exist)")
        opener = open_file if guard is None else confined(path, guard)
        config = read_json(path / "config.json", opener=opener)
        if not isinstance(config, dict):
            raise CheckpointError.at(path / "config.json", "must be a JSON object")
        files, expected = _weight_files(path, opener)
        tensors = _read_tensors(path, files, expected, opener)
        if not tensors:
            raise CheckpointError.at(path, "checkpoint holds no tensors")
        if problem := layer_count_problem(config):
            raise CheckpointError.at(path / "config.json", problem)
        checkpoint = cls(path, config, tensors, files, opener)
        if adapter is not None:
            lora = LoraAdapter.open(
                adapter, open_file if guard is None else confined(adapter, guard)
            )
            lora.check(tensors, path)
            checkpoint.adapter = lora
        if isinstance(stack := checkpoint.layer_stack, Refusal) and stack.contradiction:
            raise CheckpointError.at(path, stack.reason)
        return checkpoint

    @property
    def text_config(self) -> dict[str, Any]:
        nested = self.config.get("text_config")
        return nested if isinstance(nested, dict) else self.config

    @property
    def model_type(self) -> str:
        return model_type_of(self.config)

    @cached_property
    def layer_stack(self) -> LayerStack | Refusal:
        """The language model's layer stack, or why there is not exactly one (only methods
        that treat layers differently refuse then; open() refuses a contradiction)."""
        return find_layer_stack(self.config, self.tensors)

    def require_layers(self, purpose: str) -> LayerStack:
        """The language model's layer stack; refuse when there is not exactly one.

        For what treats layers differently from the rest (a layer swap, per-layer analysis):
        an unrecognised layout would otherwise make every layer a non-layer tensor and give a
        wrong result without an error.
        """
        stack = self.layer_stack
        if isinstance(stack, Refusal):
            raise CheckpointError.at(
                self.path, f"{purpose} needs the language model's layer stack, but {stack.reason}"
            )
        return stack

    def fd(self, file: Path) -> int:
        """A cached read-only descriptor for one of this checkpoint's weight files."""
        if file not in self._fds:
            try:
                self._fds[file] = self.opener(file)
            except OSError as e:
                raise CheckpointError.at(file, f"cannot open: {e.strerror}") from None
        return self._fds[file]

    def adapts(self, name: str) -> bool:
        """Whether tensor `name`'s bytes are not the file's: a LoRA adapter changes it (by the
        name in its file, which a view that renames layers keeps)."""
        return self.adapter is not None and self.tensors[name].name in self.adapter.targets

    def read_into(self, info: TensorInfo, buffer: memoryview, first_byte: int = 0) -> None:
        """Fill `buffer` with the tensor's bytes starting at `first_byte` within the tensor."""
        if self.adapter is not None and info.name in self.adapter.targets:
            self.adapter.read_into(info, self.fd(info.file), buffer, first_byte)
            return
        fd, offset, view = self.fd(info.file), info.start + first_byte, buffer
        while len(view):
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise CheckpointError.at(info.file, f"truncated while reading {info.name!r}")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.adapter is not None:
            self.adapter.close()


def read_json(path: Path, limit: int = MAX_JSON_BYTES, *, opener: Opener = open_file) -> Any:
    """A checkpoint's JSON file, parsed; a CheckpointError naming the file when it is missing,
    not a regular file, larger than `limit` bytes, refused by `opener` or not JSON."""
    try:
        return json.loads(read_file(path, limit, opener).decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError.at(path, "missing") from None
    except RecursionError:
        raise CheckpointError.at(path, "JSON nested too deeply") from None
    # ValueError covers bad JSON, bad UTF-8 and integers too long for Python to convert.
    except (OSError, ValueError) as e:
        raise CheckpointError.at(path, f"not valid JSON ({str(e)[:200]})") from None


def set_config_values(config: dict[str, Any], changes: dict[str, Any]) -> None:
    """Set config.json's values at dotted keys (`text_config.num_hidden_layers`), in place."""
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        section = config
        for part in parents:
            section = section[part]
        section[key] = value


def _read_tensors(
    path: Path, files: list[Path], expected: dict[str, str] | None, opener: Opener
) -> dict[str, TensorInfo]:
    """Every tensor of the weight files, by name: each in one file, and where the index (the
    `expected` weight map, when sharded) says."""
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        found, _ = read_header(file, opener)
        if len(tensors) + len(found) > MAX_TENSORS:
            raise CheckpointError.at(path, f"more than {MAX_TENSORS} tensors")
        for name, info in found.items():
            if name in tensors:
                raise CheckpointError.at(
                    file, f"tensor {quoted(name)} also in {tensors[name].file}"
                )
            if expected is not None and expected.get(name) != file.name:
                raise CheckpointError.at(
                    path / INDEX_FILE, f"tensor {quoted(name)} in {file.name} is not indexed there"
                )
            tensors[name] = info
    if expected is not None and (missing := sorted(set(expected) - set(tensors))):
        raise CheckpointError.at(
            path / INDEX_FILE, f"indexed tensors missing from the shards: {missing[:5]}"
        )
    return tensors


def _weight_files(path: Path, opener: Opener) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read and, for a sharded checkpoint, the index's weight map."""
    index = path / INDEX_FILE
    if index.is_file():
        data = read_json(index, opener=opener)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and "/" not in v and "\0" not in v and v.endswith(".safetensors")
            for v in weight_map.values()
        ):
            raise CheckpointError.at(index, "weight_map must map tensor names to shard files")
        if len(weight_map) > MAX_TENSORS:
            raise CheckpointError.at(index, f"more than {MAX_TENSORS} tensors")
        files = _at_most(sorted({path / v for v in weight_map.values()}), index)
        for file in files:
            if not file.is_file():
                raise CheckpointError.at(file, "listed in the index but missing")
        return files, weight_map
    files = _at_most(sorted(path.glob("*.safetensors")), path)
    if files:
        return files, None
    if pickled := sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES):
        raise CheckpointError.at(
            path,
            f"only pickle weights found ({', '.join(pickled)}); they can run code when loaded, "
            "so they are refused. Convert them once, somewhere trusted: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, "
            "safe_serialization=True)",
        )
    raise CheckpointError.at(path, "no *.safetensors weights found")


def _at_most(files: list[Path], where: Path) -> list[Path]:
    if len(files) > MAX_WEIGHT_FILES:
        raise CheckpointError.at(where, f"{len(files)} weight files; at most {MAX_WEIGHT_FILES}")
    return files
