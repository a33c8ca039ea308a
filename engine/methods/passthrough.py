"""mergekit's `passthrough` over slices: layers of the models, stacked into a new depth.

Output layer k is input layer j of the slice's model, every tensor of it copied and renumbered
(`model.layers.j.…` -> `model.layers.k.…`). As in mergekit, the tensors before the stack (the
embeddings) come from the first slice's model and those after it (final norm, head) from the
last slice's; config.json and the tokenizer come from the first slice's model, with its layer
count rewritten. Nothing is computed: every tensor is a whole-file-range copy.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from engine.architectures import LayerStack
from engine.errors import CheckpointError, RecipeError
from engine.limits import MAX_LAYERS
from engine.methods.base import Inputs, Method, MethodPlan, Placement
from engine.plan.model import Op, Term
from engine.schema.parts import (
    MAX_MODELS,
    MAX_SLICES,
    ModelsRecipe,
    Source,
    Strict,
)
from engine.translation.config import MergekitConfig
from engine.translation.settings import Place, chain, constant, number
from engine.translation.translators import Parameter, Translation


class LayerSource(Strict):
    model: Source = Field(description="one of the recipe's models, written as there")
    layer_range: tuple[int, int] = Field(
        description="[start, end): its layers start..end-1, as mergekit's layer_range"
    )

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= value[0] < value[1]:
            raise ValueError(f"must be [start, end) with 0 <= start < end (got {list(value)})")
        return value


class PassthroughSlice(Strict):
    # mergekit's passthrough takes one source per slice; the list keeps its config's shape.
    sources: list[LayerSource] = Field(min_length=1, max_length=1)


class PassthroughParams(Strict):
    slices: list[PassthroughSlice] = Field(
        min_length=1,
        max_length=MAX_SLICES,
        description="stacked in order: output layer k is the k-th layer the slices list",
    )


class PassthroughRecipe(ModelsRecipe):
    """mergekit's `passthrough` over `slices`: layers of the models stacked into a new depth."""

    method: Literal["passthrough"]
    base: None = Field(None, description="not used")
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: PassthroughParams  # no default: which layers to stack is the recipe

    @model_validator(mode="after")
    def _sources_are_models(self) -> Self:
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


def _layers(recipe: PassthroughRecipe, inputs: Inputs) -> list[tuple[int, int]]:
    """(input, input layer) for each output layer, in order; each range checked against its
    model's layers."""
    models = inputs.indices("model")
    stacked: list[tuple[int, int]] = []
    for i, piece in enumerate(recipe.params.slices):
        source = piece.sources[0]
        model = models[recipe.models.index(source.model)]
        count = inputs.checkpoints[model].require_layers(recipe.method).count
        start, end = source.layer_range
        if end > count:
            raise RecipeError.for_field(
                f"params.slices.{i}.sources.0.layer_range",
                f"[{start}, {end}) is outside {source.model}, which has {count} layers",
            )
        stacked += [(model, j) for j in range(start, end)]
    if len(stacked) > MAX_LAYERS:
        raise RecipeError.for_field(
            "params.slices", f"stack {len(stacked)} layers; at most {MAX_LAYERS}"
        )
    return stacked


def _renamed(name: str, stack: LayerStack, layer: int) -> str:
    return f"{stack.prefix}.{layer}.{name.removeprefix(stack.prefix + '.').split('.', 1)[1]}"


def plan_passthrough(recipe: PassthroughRecipe, inputs: Inputs) -> MethodPlan:
    stacked = _layers(recipe, inputs)
    first, last = stacked[0][0], stacked[-1][0]
    checkpoint = inputs.checkpoints[first]
    stack = checkpoint.require_layers(recipe.method)  # the inputs share names (compatibility.py)
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
    label = inputs.refs
    placements = [Placement(n, first, n, None, label[first].label) for n in outside
                  if not after_stack(n)]  # fmt: skip
    for k, (model, j) in enumerate(stacked):
        placements += [
            Placement(_renamed(n, stack, k), model, n, k, f"{label[model].label} layer {j}")
            for n in by_layer.get(j, [])
        ]
    placements += [Placement(n, last, n, None, label[last].label) for n in outside
                   if after_stack(n)]  # fmt: skip

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        raise AssertionError("passthrough places every tensor itself")  # never asked

    return MethodPlan(
        rule=rule,
        config_input=first,
        tokenizer_input=first,
        resolved_weights={"layers": len(stacked)},
        placements=tuple(placements),
        num_layers=len(stacked),
    )


def translate_passthrough(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """The config's slices as written, one source each; `scale` only as 1."""
    if config.slices is None:
        raise RecipeError.for_field("models", "Layerswap's passthrough takes slices, not models")
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
        if scale and constant(scale, "Layerswap's passthrough copies layers", missing="") != 1.0:
            raise RecipeError.for_field(scale[0].field, "Layerswap's passthrough does not scale")
        slices.append(
            {"sources": [{"model": source.source, "layer_range": list(piece.layer_range)}]}
        )
    models = list(dict.fromkeys(s["sources"][0]["model"] for s in slices))
    return {"models": models, "params": {"slices": slices}}


METHOD = Method(
    name="passthrough",
    recipe=PassthroughRecipe,
    params=PassthroughParams,
    plan=plan_passthrough,
    summary="layers of the models stacked by slices into a deeper or shallower model (mergekit's)",
    formula="layer k of the output = layer j of model m, the k-th of the layers the slices "
    "list (each [a, b) of its model m), copied",
    title="a passthrough merge (layers of the inputs stacked, as mergekit's slices)",
    tags=("passthrough", "frankenmerge"),
    base="unused",
    layer_stack="restacked",
    pair_baseline=False,
    # mergekit's scale (unset: none) multiplies a copied tensor; Layerswap takes only 1
    mergekit=Translation(
        names=("passthrough",),
        translate=translate_passthrough,
        parameters=(Parameter("scale", None, per_model=True),),
    ),
)
