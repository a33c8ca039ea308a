"""mergekit's `passthrough`: layers of the models, stacked by slices into a new depth.

Output layer k is input layer j of the slice's model, every tensor of it copied and renumbered
(`model.layers.j.…` -> `model.layers.k.…`). As in mergekit, the tensors before the stack (the
embeddings) come from the first slice's model and those after it (final norm, head) from the
last slice's; config.json and the tokenizer come from the first slice's model, with its layer
count rewritten. A source's `scale` (mergekit's) multiplies the tensors taken from it: a tensor
whose scale resolves to a number other than 1 is computed (`linear`, one term: the tensor times
the scale, rounded as mergekit's `tensor * scale`); every other tensor is a whole-file-range copy.
Without slices, the recipe's one model is copied whole (mergekit's passthrough over `models`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from engine.architectures import LayerStack
from engine.errors import CheckpointError, RecipeError
from engine.io.checkpoint import Checkpoint
from engine.io.safetensors_format import FLOAT_DTYPES, TensorInfo
from engine.limits import MAX_LAYERS
from engine.methods.base import Inputs, Method, MethodPlan, Placement
from engine.plan.model import Op, Term
from engine.schema.parts import (
    MAX_MODELS,
    MAX_SLICES,
    LayerSource,
    ModelsRecipe,
    Source,
    Strict,
)
from engine.schema.settings import Setting, position, resolve
from engine.translation.config import MergekitConfig
from engine.translation.settings import Condition, Place, as_setting, chain, number
from engine.translation.translators import Parameter, Translation

_SCALE = (
    "multiplies each tensor taken from it, as mergekit's `scale`: a number, a gradient over "
    "its slice's layers (the first at 0, the last at 1; tensors before and after the stack at "
    "0), or {filter, value} conditions matched against the input tensor's name; absent, or "
    "where no condition matches: the tensor copied as it is"
)


# Unset (None): no scale. Annotated keeps it a setting to describe() (a union would flatten it).
Scale = Annotated[Setting, Field()] | None


class _Unset(Strict):
    """Written without its unset options: a recipe that sets none dumps (and digests) as
    before they were options."""

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if k not in ("scale", "slices") or v is not None}


class PassthroughSource(LayerSource, _Unset):
    scale: Scale = Field(None, description=_SCALE)


class PassthroughSlice(Strict):
    # mergekit's passthrough takes one source per slice; the list keeps its config's shape.
    sources: list[PassthroughSource] = Field(min_length=1, max_length=1)


class PassthroughParams(_Unset):
    slices: list[PassthroughSlice] | None = Field(
        None,
        min_length=1,
        max_length=MAX_SLICES,
        description="stacked in order: output layer k is the k-th layer the slices list; "
        "absent: every layer of the recipe's one model (mergekit's passthrough over models)",
    )
    scale: Scale = Field(
        None, description="without slices: the one model's scale (as a source's, which "
        "sets it with slices); " + _SCALE.split(": ", 1)[1]
    )  # fmt: skip


class PassthroughRecipe(ModelsRecipe):
    """mergekit's `passthrough`: layers of the models stacked into a new depth by `slices`, or
    one model copied whole, each maybe scaled."""

    method: Literal["passthrough"]
    base: None = Field(None, description="not used")
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    slices: None = Field(None, description="not used: params.slices stack the layers")
    params: PassthroughParams  # no default: which layers to stack is the recipe

    @model_validator(mode="after")
    def _sources_are_models(self) -> Self:
        if self.params.slices is None:
            if len(self.models) != 1:
                raise ValueError(
                    f"models lists {len(self.models)}: without params.slices passthrough "
                    "copies one model whole (as mergekit's over models); stack layers of "
                    "several with params.slices"
                )
            return self
        if self.params.scale is not None:
            raise ValueError("params.scale is set beside params.slices: each source sets its own")
        used = set()
        for i, piece in enumerate(self.params.slices):
            model = piece.sources[0].model
            if model not in self.models:
                raise ValueError(f"params.slices.{i}.sources.0.model {model!r} is not in models")
            used.add(model)
        for i, model in enumerate(self.models):
            if model not in used:  # opened and checked for nothing
                raise ValueError(f"models.{i} {model!r} is not used by any of params.slices")
        return self


# mergekit's architecture files list, per family, the non-layer tensors that follow the stack
# (post_weights: the final norm and the head); here they are told apart by a name component.
_AFTER_STACK = frozenset(
    {"norm", "ln_f", "norm_f", "final_layernorm", "final_layer_norm", "lm_head", "embed_out",
     "score"}
)  # fmt: skip


def after_stack(name: str) -> bool:
    """Whether a non-layer tensor follows the layer stack (final norm, head)."""
    return any(part in _AFTER_STACK for part in name.split("."))


@dataclass(frozen=True)
class _Piece:
    """One run of stacked layers: [start, end) of input `model`, scaled by `scale`."""

    field: str
    model: int
    start: int
    end: int
    scale: Setting | None


def _pieces(recipe: PassthroughRecipe, inputs: Inputs) -> list[_Piece]:
    """The runs of layers stacked, in order (the one model whole without slices), each range
    checked against its model's layers."""
    models = inputs.indices("model")
    if recipe.params.slices is None:
        count = inputs.checkpoints[models[0]].require_layers(recipe.method).count
        return [_Piece("params", models[0], 0, count, recipe.params.scale)]
    pieces = []
    for i, piece in enumerate(recipe.params.slices):
        source, field = piece.sources[0], f"params.slices.{i}.sources.0"
        model = models[recipe.models.index(source.model)]
        count = inputs.checkpoints[model].require_layers(recipe.method).count
        start, end = source.layer_range
        if end > count:
            raise RecipeError.for_field(
                f"{field}.layer_range",
                f"[{start}, {end}) is outside {source.model}, which has {count} layers",
            )
        pieces.append(_Piece(field, model, start, end, source.scale))
    if (layers := sum(p.end - p.start for p in pieces)) > MAX_LAYERS:
        raise RecipeError.for_field("params.slices", f"stack {layers} layers; at most {MAX_LAYERS}")
    return pieces


def _scale(piece: _Piece, name: str, offset: int | None, info: TensorInfo) -> float:
    """The tensor's scale, resolved as mergekit resolves it: against the input tensor's name,
    a layer at its place within its slice, a tensor outside the stack at 0. 1: none."""
    if piece.scale is None:
        return 1.0
    at = 0.0 if offset is None else position(offset, piece.end - piece.start)
    found = resolve(piece.scale, name=name, at=at)
    if found is None or found == 1.0:
        return 1.0
    if info.dtype not in FLOAT_DTYPES:
        raise RecipeError.for_field(
            f"{piece.field}.scale", f"{name} is {info.dtype}: only float tensors are scaled"
        )
    return found


def _renamed(name: str, stack: LayerStack, layer: int) -> str:
    return f"{stack.prefix}.{layer}.{name.removeprefix(stack.prefix + '.').split('.', 1)[1]}"


def _by_layer(checkpoint: Checkpoint, stack: LayerStack) -> tuple[dict[int, list[str]], list[str]]:
    """The checkpoint's tensor names by layer, in file order, and those outside the stack."""
    by_layer: dict[int, list[str]] = {}
    outside: list[str] = []
    for info in sorted(checkpoint.tensors.values(), key=lambda t: (str(t.file), t.start)):
        layer = stack.layer_of(info.name)
        if layer is None and info.name.startswith(stack.prefix + "."):
            # numbered past the stack (DeepSeek-V3's multi-token prediction): its index would
            # no longer follow the new stack
            raise CheckpointError.at(
                checkpoint.path, f"passthrough cannot renumber {info.name}, past the layer stack"
            )
        (outside if layer is None else by_layer.setdefault(layer, [])).append(info.name)
    return by_layer, outside


def plan_passthrough(recipe: PassthroughRecipe, inputs: Inputs) -> MethodPlan:
    pieces = _pieces(recipe, inputs)
    first, last = pieces[0], pieces[-1]
    checkpoint = inputs.checkpoints[first.model]
    stack = checkpoint.require_layers(recipe.method)  # the inputs share names (compatibility.py)
    by_layer, outside = _by_layer(checkpoint, stack)
    label = inputs.refs

    def around(piece: _Piece, names: list[str]) -> list[Placement]:
        tensors = inputs.checkpoints[piece.model].tensors
        return [Placement(n, piece.model, n, None, label[piece.model].label,
                          _scale(piece, n, None, tensors[n])) for n in names]  # fmt: skip

    placements = around(first, [n for n in outside if not after_stack(n)])
    k = 0
    for piece in pieces:
        tensors, origin = inputs.checkpoints[piece.model].tensors, label[piece.model].label
        for offset, j in enumerate(range(piece.start, piece.end)):
            placements += [
                Placement(_renamed(n, stack, k), piece.model, n, k, f"{origin} layer {j}",
                          _scale(piece, n, offset, tensors[n]))
                for n in by_layer.get(j, [])
            ]  # fmt: skip
            k += 1
    placements += around(last, [n for n in outside if after_stack(n)])

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        raise AssertionError("passthrough places every tensor itself")  # never asked

    return MethodPlan(
        rule=rule,
        config_input=first.model,
        tokenizer_input=first.model,
        resolved_weights={"layers": k},
        placements=tuple(placements),
        num_layers=k,
    )


def translate_passthrough(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """The config's slices as written, one source each, each with its scale (the source's,
    then its slice's, then the config's); or its one model, copied whole."""
    if config.slices is None:
        return _translate_models(config)
    if config.base is not None:
        config.warnings.append("base_model: passthrough merges no base; ignored")
    slices = []
    for piece in config.slices:
        if len(piece.inputs) != 1:
            raise RecipeError.for_field(
                f"{piece.field}.sources", "mergekit's passthrough takes one source per slice"
            )
        (source,) = piece.inputs
        places = [
            (f"{source.field}.parameters", source.parameters),
            (f"{piece.field}.parameters", piece.parameters),
            *config.shared_blocks,
        ]
        scale = chain([Place(f"{w}.scale", b["scale"]) for w, b in places if "scale" in b], number)
        entry = {"model": source.source, "layer_range": list(piece.layer_range)}
        slices.append({"sources": [entry | _scale_setting(scale)]})
    models = list(dict.fromkeys(s["sources"][0]["model"] for s in slices))
    return {"models": models, "params": {"slices": slices}}


def _translate_models(config: MergekitConfig) -> dict[str, Any]:
    """mergekit's passthrough over `models`: exactly one model (its base_model, if another,
    would be a second input), every layer of it, maybe scaled."""
    if len(config.inputs) != 1:
        raise RecipeError.for_field(
            "models",
            f"lists {len(config.inputs)} models: mergekit's passthrough over models takes "
            "exactly one; stack layers of several with slices",
        )
    (model,) = config.inputs
    if config.base is not None and config.base.source != model.source:
        raise RecipeError.for_field(
            config.base_field,
            "another model than the one of models: mergekit's passthrough over models would "
            "take it as a second input, and takes exactly one",
        )
    scale = config.model_chain(model, "scale", number)
    return {"models": [model.source], "params": _scale_setting(scale)}


def _scale_setting(scale: list[Condition]) -> dict[str, Any]:
    """{"scale": setting}, or nothing where every tensor is copied as it is (none, or 1)."""
    if not scale or (scale[0].matches_all and scale[0].value == 1.0):
        return {}
    return {"scale": as_setting(scale)}


METHOD = Method(
    name="passthrough",
    recipe=PassthroughRecipe,
    params=PassthroughParams,
    plan=plan_passthrough,
    summary="layers of the models stacked by slices into a deeper or shallower model (mergekit's)",
    formula="layer k of the output = layer j of model m, the k-th of the layers the slices "
    "list (each [a, b) of its model m), copied, or times its source's scale if one is set",
    title="a passthrough merge (layers of the inputs stacked, as mergekit's slices)",
    tags=("passthrough", "frankenmerge"),
    base="unused",
    layer_stack="restacked",
    pair_baseline=False,
    # mergekit's scale (unset: none) multiplies a copied tensor
    mergekit=Translation(
        names=("passthrough",),
        translate=translate_passthrough,
        parameters=(Parameter("scale", None, per_model=True),),
    ),
)
