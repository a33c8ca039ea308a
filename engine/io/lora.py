"""A PEFT LoRA adapter read beside the model it adapts: a `model+adapter` source.

Each weight the adapter targets is read as W + scaling·(B @ A), made when the tensor is first
read, one tensor at a time (never the whole model), in the order and with the roundings of
PEFT's merge_and_unload on the CPU, which is how mergekit merges a LoRA before it merges models:
A and B in float32 (float64 beside a float64 weight), their product transposed where the adapter
says fan_in_fan_out, scaled by lora_alpha / r (lora_alpha / √r with use_rslora) in that dtype,
then added to the weight, the sum rounded once to the weight's dtype. Every other tensor is
the model's own. What changes a layer in any other way (DoRA, embedding LoRA, trained biases,
modules_to_save) is refused by the adapter_config.json field that asks for it.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import CheckpointError, RecipeError, quoted
from engine.io.file_access import Opener, open_file, read_file
from engine.io.safetensors_format import FLOAT_DTYPES, TensorInfo, read_header
from engine.limits import MAX_JSON_BYTES

if TYPE_CHECKING:
    import torch

SEPARATOR = "+"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's key for one half of a target's update: base_model.model.<module>.lora_<A|B>.weight
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
# adapter_config.json fields that change a layer otherwise than W + scaling·(B @ A): each must
# be absent or off.
UNSUPPORTED = {
    "use_dora": "DoRA (a magnitude vector rescales the merged weight)",
    "modules_to_save": "whole modules saved beside the adapter",
    "lora_bias": "a trained bias on lora_B",
    "rank_pattern": "ranks that vary by module",
    "alpha_pattern": "alphas that vary by module",
    "layer_replication": "layers replicated by the adapter",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on parameters rather than modules",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "velora_config": "a LoRA variant",
    "kasa_config": "a LoRA variant",
    "monteclora_config": "a LoRA variant",
}
_UPDATE_ELEMENTS = 1 << 18  # the update is added a block of rows of about this many at a time
_ADAPTED_KEPT = 1  # adapted tensors kept made: the kernels' threads read one's parts, then the next


def split_source(source: str) -> tuple[str, str | None]:
    """`model+adapter` -> (model, adapter); a plain source -> (source, None)."""
    if SEPARATOR not in source:
        return source, None
    model, _, adapter = source.partition(SEPARATOR)
    if not model or not adapter or SEPARATOR in adapter:
        raise RecipeError.for_field(
            "source", f"{quoted(source)}: a LoRA reference is model+adapter, one of each"
        )
    return model, adapter


@dataclass(frozen=True)
class Target:
    """One adapted weight: its update's halves in the adapter file."""

    a: TensorInfo  # [r, in]
    b: TensorInfo  # [out, r]


@dataclass
class LoraAdapter:
    path: Path
    scaling: float
    fan_in_fan_out: bool
    targets: dict[str, Target]  # by the name of the weight each adapts
    opener: Opener = field(default=open_file, repr=False)
    _made: OrderedDict[str, memoryview] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, path: Path, opener: Opener = open_file) -> LoraAdapter:
        """Read and check an adapter directory (its config and header only)."""
        if not path.is_dir():
            raise CheckpointError.at(path, "not a LoRA adapter directory (does not exist)")
        config = _config(path / ADAPTER_CONFIG, opener)
        r, scaling = _scaling(config, path / ADAPTER_CONFIG)
        weights = path / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise CheckpointError.at(weights, "missing (only safetensors adapters are read)")
        tensors, _ = read_header(weights, opener)
        targets = _targets(weights, tensors, r)
        return cls(path, scaling, bool(config.get("fan_in_fan_out")), targets, opener)

    def check(self, tensors: dict[str, TensorInfo], model: Path) -> None:
        """Refuse an adapter whose targets the model lacks, or of other shapes."""
        for name, target in self.targets.items():
            info = tensors.get(name)
            if info is None:
                raise CheckpointError.at(
                    self.path, f"adapts {quoted(name)}, which {model} does not hold"
                )
            out = target.b.shape[0]
            shape = (target.a.shape[1], out) if self.fan_in_fan_out else (out, target.a.shape[1])
            if info.dtype not in FLOAT_DTYPES or info.shape != shape:
                raise CheckpointError.at(
                    self.path,
                    f"its update of {quoted(name)} is {list(shape)}, the weight "
                    f"{info.dtype} {list(info.shape)}",
                )

    def read_into(self, weight: TensorInfo, fd: int, buffer: memoryview, first_byte: int) -> None:
        """Fill `buffer` with the adapted weight's bytes from `first_byte` on."""
        made = self._adapted(weight, fd)
        view = buffer if buffer.format == "B" and buffer.ndim == 1 else buffer.cast("B")
        view[:] = made[first_byte : first_byte + len(view)]

    def _adapted(self, weight: TensorInfo, fd: int) -> memoryview:
        with self._lock:  # the kernels' threads read parts of one tensor side by side
            if (found := self._made.get(weight.name)) is None:
                found = self._made[weight.name] = self._make(weight, fd)
                while len(self._made) > _ADAPTED_KEPT:
                    self._made.popitem(last=False)
            return found

    def _make(self, weight: TensorInfo, fd: int) -> memoryview:
        """The adapted weight's bytes: B @ A made whole, as PEFT makes it (MKL's product of a
        block of rows is not always, to the bit, those rows of the whole product), then added
        into the weight a block of rows at a time (elementwise: the same bits) so that the
        addition makes no whole-weight float32 temporary."""
        # torch: seconds to import; its matmul and in-place add are PEFT's, to the bit
        import torch

        w = _tensor(fd, weight)
        target = self.targets[weight.name]
        # PEFT upcasts the adapter to float32 (keeps a float64 one's base dtype) before merging
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        adapter_fd = self._open(target.a.file)
        try:
            a, b = (_tensor(adapter_fd, t).to(dtype) for t in (target.a, target.b))
        finally:
            os.close(adapter_fd)
        update = (b @ a).mul_(self.scaling)
        if self.fan_in_fan_out:  # w is (B @ A)ᵀ's shape
            update = update.T
        # w and update: matrices of one shape (check() refuses an adapter of any other)
        step = max(1, _UPDATE_ELEMENTS // max(1, w.shape[1]))
        for lo in range(0, w.shape[0], step):
            w[lo : lo + step] += update[lo : lo + step]
        return w.view(-1).view(torch.uint8).numpy().data

    def _open(self, file: Path) -> int:
        try:
            return self.opener(file)
        except OSError as e:
            raise CheckpointError.at(file, f"cannot open: {e.strerror}") from None

    def close(self) -> None:
        self._made.clear()


def _config(path: Path, opener: Opener) -> dict[str, Any]:
    try:
        config = json.loads(read_file(path, MAX_JSON_BYTES, opener).decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError.at(path, "missing: a LoRA adapter needs its PEFT config") from None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError.at(path, f"not valid JSON ({str(e)[:200]})") from None
    if not isinstance(config, dict):
        raise CheckpointError.at(path, "must be a JSON object")
    if (kind := config.get("peft_type", "LORA")) != "LORA":
        raise CheckpointError.at(path, f"peft_type: {quoted(kind)} adapters are not supported")
    if config.get("bias", "none") != "none":
        raise CheckpointError.at(path, f"bias: {quoted(config['bias'])} (trained biases) is "
                                 "not supported")  # fmt: skip
    for key, what in UNSUPPORTED.items():
        if config.get(key) not in (None, False, {}, []):
            raise CheckpointError.at(path, f"{key}: {what} is not supported")
    return config


def _targets(weights: Path, tensors: dict[str, TensorInfo], r: int) -> dict[str, Target]:
    """The adapted weights' names, each with its A and B, checked: both halves, rank r."""
    halves: dict[str, dict[str, TensorInfo]] = {}
    for key, info in tensors.items():
        match = _KEY.match(key)
        if match is None:
            embedding = "lora_embedding_" in key
            why = "embedding LoRA" if embedding else "not a LoRA update of a linear layer"
            raise CheckpointError.at(weights, f"{quoted(key)}: {why}; not supported")
        if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
            raise CheckpointError.at(weights, f"{quoted(key)}: must be a float matrix")
        halves.setdefault(f"{match['module']}.weight", {})[match["half"]] = info
    targets = {}
    for name, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise CheckpointError.at(
                weights, f"{quoted(name)}: lora_A and lora_B must both be there"
            )
        a, b = pair["A"], pair["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise CheckpointError.at(
                weights, f"{quoted(name)}: A {list(a.shape)} and B {list(b.shape)}, not of rank {r}"
            )
        targets[name] = Target(a, b)
    if not targets:
        raise CheckpointError.at(weights, "holds no LoRA updates")
    return targets


def _scaling(config: dict[str, Any], where: Path) -> tuple[int, float]:
    """(r, scaling) as PEFT computes them: lora_alpha / r, or lora_alpha / √r (rsLoRA)."""
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise CheckpointError.at(where, f"r: {quoted(r)} is not a rank")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise CheckpointError.at(where, f"lora_alpha: {quoted(alpha)} is not a number")
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _tensor(fd: int, info: TensorInfo) -> torch.Tensor:
    """One tensor of an open file, read whole into memory of its own (writable)."""
    # torch: seconds to import; loaded only once a LoRA-adapted tensor is read
    import torch

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16}  # fmt: skip
    data = bytearray(info.nbytes)
    view, offset = memoryview(data), info.start
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise CheckpointError.at(info.file, f"truncated while reading {quoted(info.name)}")
        view, offset = view[n:], offset + n
    if not data:
        return torch.zeros(info.shape, dtype=dtypes[info.dtype])
    return torch.frombuffer(data, dtype=dtypes[info.dtype]).reshape(info.shape)
