"""A recipe's `slices` (mergekit's, outside passthrough): output layer k of a slice is merged
from layer start+k of each source, the start its own.

Each input is seen through a view that names its tensors as the output does (input layer
start+k of the slice is the view's layer k, after the earlier slices' layers; the non-layer
tensors as they are) and says the output's layer count, so the method plans over views as
over whole models of the output's depth, and every output tensor still reads one range of
one file per input. Nothing is copied: the view's tensors are the input's own, each still
named as in its file (TensorInfo.name), and the view owns what the input opened.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import replace

from engine.architectures import LayerStack
from engine.errors import CheckpointError, RecipeError
from engine.io.checkpoint import Checkpoint, set_config_values
from engine.limits import MAX_LAYERS
from engine.plan.model import InputRef
from engine.schema.parts import LayerSlice

# The tensors before the layers (mergekit's pre_weights: token and position embeddings and
# their norms); every other tensor outside the layers comes after them (final norm, head).
_BEFORE_LAYERS = re.compile(
    r"(^|\.)((?!embed_out\b)embed\w*|\w*embeddings?\w*|wte|wpe|shared)(\.|$)"
)


def input_layers(
    slices: Sequence[LayerSlice], refs: Sequence[InputRef], checkpoints: Sequence[Checkpoint]
) -> list[list[int | None]]:
    """Per input, the input layer each output layer reads, checked against its layers; None
    for the layers of a slice that does not merge it."""
    layers: list[list[int | None]] = [[] for _ in refs]
    for s, piece in enumerate(slices):
        for ref in set(range(len(refs))) - {_ref(refs, x.model) for x in piece.sources}:
            layers[ref] += [None] * piece.layer_count
        for i, source in enumerate(piece.sources):
            ref = _ref(refs, source.model)
            count = checkpoints[ref].require_layers("slices").count
            start, end = source.layer_range
            if end > count:
                raise RecipeError.for_field(
                    f"slices.{s}.sources.{i}.layer_range",
                    f"[{start}, {end}) is outside {source.model}, which has {count} layers",
                )
            layers[ref] += range(start, end)
    if len(layers[0]) > MAX_LAYERS:
        raise RecipeError.for_field(
            "slices", f"stack {len(layers[0])} layers; at most {MAX_LAYERS}"
        )
    return layers


def _ref(refs: Sequence[InputRef], source: str) -> int:
    return next(r for r, found in enumerate(refs) if found.source == source)


def restacked(checkpoint: Checkpoint, layers: Sequence[int | None]) -> Checkpoint:
    """`checkpoint` as the output names its tensors: view layer k is its layer layers[k]; a
    layer it does not merge (None) is its layer 0, which no plan reads but which keeps the
    views alike (checked against each other as whole models)."""
    stack = checkpoint.require_layers("slices")
    tensors = {}
    by_layer: dict[int, list[str]] = {}
    for name, info in checkpoint.tensors.items():
        layer = stack.layer_of(name)
        if layer is None and name.startswith(stack.prefix + "."):
            # numbered past the stack (multi-token prediction): its index would not follow
            raise CheckpointError.at(
                checkpoint.path, f"slices cannot renumber {name}, past the layer stack"
            )
        if layer is None:
            tensors[name] = info
        else:
            by_layer.setdefault(layer, []).append(name)
    for k, j in enumerate(layers):  # each info keeps its name in its file
        tensors.update({_renamed(name, stack, k): checkpoint.tensors[name]
                        for name in by_layer.get(0 if j is None else j, [])})  # fmt: skip
    config = copy.deepcopy(checkpoint.config)
    set_config_values(config, {stack.count_key: len(layers)})
    return replace(checkpoint, config=config, tensors=tensors, _fds={})


def _renamed(name: str, stack: LayerStack, layer: int) -> str:
    return f"{stack.prefix}.{layer}.{name.removeprefix(stack.prefix + '.').split('.', 1)[1]}"


def described(slices: Sequence[LayerSlice], refs: Sequence[InputRef]) -> list[dict[str, list[int]]]:
    """Per slice, each input's range by its label: what the plan records of the slices."""
    label = {ref.source: ref.label for ref in refs}
    return [{label[s.model]: list(s.layer_range) for s in piece.sources} for piece in slices]


def read_at(refs: Sequence[InputRef], layers: Sequence[Sequence[int | None]], layer: int) -> str:
    """Which layer of each input output layer `layer` merges (models[0] layer 2, ...)."""
    pairs = zip(refs, layers, strict=True)
    return ", ".join(
        f"{ref.label} layer {found[layer]}" for ref, found in pairs if found[layer] is not None
    )


def slice_of(layer: int, counts: Sequence[int]) -> int:
    """The slice that stacks output layer `layer`, from the slices' layer counts."""
    for s, count in enumerate(counts):
        if layer < count:
            return s
        layer -= count
    raise ValueError(f"layer {layer} is past the slices")


def before_layers(name: str) -> bool:
    """Whether a tensor outside the layers comes before them (mergekit merges those by its
    first slice, the others by its last)."""
    return _BEFORE_LAYERS.search(name) is not None
