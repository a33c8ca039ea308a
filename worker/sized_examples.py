"""The example experts at about a given checkpoint size (`layerswap examples --size 1GB`).

The same base, math and swh Llama checkpoints as worker.examples, with more and wider layers:
the hidden size grows with the target, the layer count about hidden/128 (at least the examples'
6), so the weights come to within a layer's bytes of it. Each checkpoint is written tensor by
tensor: a safetensors file's header is known from the shapes alone, so only one tensor is ever in
memory. An expert is its base read back one tensor at a time plus the same seeded noise as the
tiny examples', each layer's share taken from the tiny profile at the same depth.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.architectures import LayerStack, Refusal, find_layer_stack
from engine.io.safetensors_format import encode_header
from worker.examples import (
    EXAMPLE_LAYERS,
    EXPERTS,
    make_tokenizer,
    model_config,
    noise_unit,
    write_recipes,
)

SHARD_BYTES = 2 * 10**9  # as the recipes' output.shard_size
HEAD_DIM = 64
HIDDEN_STEP = 2 * HEAD_DIM  # an even number of heads: half as many key/value heads
VOCAB = 256  # the examples' tokenizer
DTYPE, DTYPE_NAME, ITEMSIZE = torch.bfloat16, "BF16", 2
INIT_STD = 0.02  # Llama's initializer_range

# (checkpoint, bytes just written, bytes in all): 0 bytes first, then after each tensor
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int

    @property
    def bytes(self) -> int:
        """The weights' size: per layer attention (q, o; k, v at half width), a 2x-wide MLP and
        two norms; besides, the embedding, the LM head (untied) and the final norm."""
        h = self.hidden
        per_layer = 2 * h * h + 2 * h * (h // 2) + 3 * h * (2 * h) + 2 * h
        return ITEMSIZE * (self.layers * per_layer + 2 * VOCAB * h + h)


SMALLEST = Shape(EXAMPLE_LAYERS, HIDDEN_STEP)


def shape_for(size: int) -> Shape:
    """The widest shape whose layer count, fitted to `size` bytes, is still at least
    max(6, hidden/128); raises ValueError below the smallest."""
    if size < SMALLEST.bytes:
        raise ValueError(f"at least {SMALLEST.bytes / 1e6:.0f}MB (got {size} bytes)")
    best, hidden = SMALLEST, HIDDEN_STEP
    while True:
        one_layer = Shape(1, hidden).bytes - Shape(0, hidden).bytes
        layers = round((size - Shape(0, hidden).bytes) / one_layer)
        if layers < max(EXAMPLE_LAYERS, hidden // 128):
            return best
        best, hidden = Shape(layers, hidden), hidden + HIDDEN_STEP


def make_sized_examples(
    out_dir: Path, size: int, *, on_progress: Progress | None = None
) -> dict[str, Path]:
    """Write base/, math/, swh/ of about `size` bytes each, the recipes and evaluation rows
    (worker.examples.make_examples' layout and keys)."""
    shape = shape_for(size)
    config = model_config(
        "llama", layers=shape.layers, hidden=shape.hidden, intermediate=2 * shape.hidden,
        vocab=VOCAB, heads=shape.hidden // HEAD_DIM, kv_heads=shape.hidden // HEAD_DIM // 2,
        tie_embeddings=False, dtype=DTYPE,
    )  # fmt: skip
    shapes = _tensor_shapes(config)
    report = on_progress or (lambda _name, _done, _total: None)
    base = out_dir / "base"
    _write_checkpoint(base, config, shapes, _random_tensors(shapes), report)
    paths = {"base": base}
    stack = find_layer_stack(config.to_dict(), shapes)
    if isinstance(stack, Refusal):
        raise ValueError(stack.reason)
    for name, (seed, profile, non_layer_scale) in EXPERTS.items():
        scales = _scales(stack, shapes, profile, non_layer_scale)
        tensors = _fine_tuned(base, shapes, seed=seed, scales=scales)
        paths[name] = _write_checkpoint(out_dir / name, config, shapes, tensors, report)
    return paths | write_recipes(out_dir, checkpoints=paths)


def _tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The model's tensors, in the model's order, from a model on the meta device (no memory)."""
    # transformers: heavy; loaded only when examples are made
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _random_tensors(shapes: dict[str, tuple[int, ...]]) -> Iterator[torch.Tensor]:
    """A base as Llama initialises one: norms 1, the rest N(0, INIT_STD), seeded."""
    generator = torch.Generator().manual_seed(0)
    for shape in shapes.values():
        if len(shape) == 1:
            yield torch.ones(shape, dtype=DTYPE)
        else:
            yield (torch.randn(shape, generator=generator) * INIT_STD).to(DTYPE)


def _scales(
    stack: LayerStack, names: Iterable[str], profile: Sequence[float], non_layer_scale: float
) -> dict[str, float]:
    """Each tensor's noise scale: the tiny profile's at the same depth in the stack, or
    `non_layer_scale` outside it."""
    scales = {}
    for name in names:
        layer = stack.layer_of(name)
        at_depth = None if layer is None else profile[layer * len(profile) // stack.count]
        scales[name] = non_layer_scale if at_depth is None else at_depth
    return scales


def _fine_tuned(
    base: Path, shapes: dict[str, tuple[int, ...]], *, seed: int, scales: dict[str, float]
) -> Iterator[torch.Tensor]:
    """The base's tensors, read one at a time, plus N(0, 1) · scale · unit(W), seeded; a layer's
    scale is the tiny profile's at the same depth."""
    generator = torch.Generator().manual_seed(seed)
    files = _shard_names(shapes)
    for name in shapes:
        with safe_open(str(base / files[name]), framework="pt") as f:
            weight = f.get_tensor(name).to(torch.float32)
        noise = torch.randn(weight.shape, generator=generator)
        unit = noise_unit(weight, INIT_STD)
        yield (weight + noise * (scales[name] * unit)).to(DTYPE)


def _shards(shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """Tensors in model order, cut into files of at most SHARD_BYTES (one tensor at least)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, shape in shapes.items():
        size = ITEMSIZE * math.prod(shape)
        if shards[-1] and filled + size > SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _shard_names(shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Tensor -> the file it is in: model.safetensors alone, else Hugging Face's numbering."""
    shards = _shards(shapes)
    if len(shards) == 1:
        return dict.fromkeys(shards[0], "model.safetensors")
    n = len(shards)
    return {t: f"model-{i:05d}-of-{n:05d}.safetensors" for i, s in enumerate(shards, 1) for t in s}


def _write_checkpoint(
    out_dir: Path,
    config: Any,
    shapes: dict[str, tuple[int, ...]],
    tensors: Iterator[torch.Tensor],
    report: Progress,
) -> Path:
    """Config, generation config, tokenizer, then the weights file by file, tensor by tensor."""
    # transformers: heavy; loaded only when examples are made
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors*"):  # an earlier size's: loaders would mix them
        stale.unlink()
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    make_tokenizer(out_dir)
    files = _shard_names(shapes)
    total = sum(ITEMSIZE * math.prod(s) for s in shapes.values())
    report(out_dir.name, 0, total)
    for file in dict.fromkeys(files.values()):
        names = [n for n in shapes if files[n] == file]
        with (out_dir / file).open("wb") as out:
            out.write(_header({n: shapes[n] for n in names}))
            for name in names:
                out.write(next(tensors).contiguous().view(torch.uint8).numpy().data)
                report(out_dir.name, ITEMSIZE * math.prod(shapes[name]), total)
    if len(set(files.values())) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": files}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out_dir


def _header(shapes: dict[str, tuple[int, ...]]) -> bytes:
    """A safetensors header for these tensors, stored in this order."""
    entries, offset = {}, 0
    for name, shape in shapes.items():
        end = offset + ITEMSIZE * math.prod(shape)
        entries[name] = {"dtype": DTYPE_NAME, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    return encode_header(entries, {"format": "pt"})
