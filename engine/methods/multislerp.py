"""mergekit's `multislerp`: spherical interpolation of any number of models by weight (the
barycentre on a hypersphere), optionally of their task vectors from a base.

Per tensor, with vᵢ = models[i] (or models[i] − base) as flat vectors and wᵢ their weights
(divided by Σ wⱼ with `normalize_weights`): uᵢ = vᵢ / (‖vᵢ‖ + ε); m = Σ wᵢ·uᵢ / ‖Σ wᵢ·uᵢ‖;
the tangent τ = Σ wᵢ·(uᵢ − ⟨uᵢ, m⟩·m) and ℓ = ‖τ‖ + ε;
out = (cos ℓ·m + sin ℓ/ℓ·τ)·Σ wᵢ‖vᵢ‖ (+ base). Two models whose directions cancel
(‖Σ wᵢ·uᵢ‖ < ε) interpolate linearly, Σ wᵢ·vᵢ; more are refused there, as by mergekit,
unless every vᵢ is zero (a tensor none of the models changed from the base: the base is kept,
where mergekit refuses).
The kernel (sphere_torch.py) holds a tensor whole when each input fits in a chunk (its N
inputs, their unit vectors and tangents: about 4·N times the tensor in float32), else reads it
five times, a chunk of each input at a time: its norms and dot products summed in torch's order
(torch_order.py), then the output; where that order is not reproduced (float16, a GPU), twice:
its Gram matrix, then the output. Weights and `normalize_weights` may vary by layer or tensor
name, as mergekit's do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan, layer_count
from engine.plan.model import Op, Term
from engine.schema.params import ONE_PER_MODEL
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict, check_base_apart
from engine.schema.settings import Setting, Switch, position, resolve, resolve_switch
from engine.translation.config import MergekitConfig
from engine.translation.settings import flag
from engine.translation.translators import (
    Parameter,
    Translation,
    read_parameters,
    require_base,
)


class MultislerpParams(Strict):
    weights: (
        Literal["uniform"]
        | Annotated[list[Setting], Field(min_length=2, max_length=MAX_MODELS), ONE_PER_MODEL]
    ) = Field(
        "uniform",
        description="one per model (mergekit's weight); uniform = 1.0 each: a number, a "
        "gradient across layers, or {filter, value}s",
    )
    normalize_weights: Switch = Field(True, description="divide the weights by their sum")
    eps: float = Field(1e-8, ge=0, description="added to norms before dividing by them")


class MultislerpRecipe(ModelsRecipe):
    """mergekit's `multislerp`; with `base`, of the task vectors models[i] − base."""

    method: Literal["multislerp"]
    base: Source | None = Field(
        None, description="interpolate models[i] − base instead, and add the result to it"
    )
    models: list[Source] = Field(min_length=2, max_length=MAX_MODELS)
    params: MultislerpParams = MultislerpParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_base_apart(self)
        weights = self.params.weights
        if isinstance(weights, list) and len(weights) != len(self.models):
            raise ValueError(
                f"params.weights has {len(weights)} entries for {len(self.models)} models"
            )
        return self


def plan_multislerp(recipe: MultislerpRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.base
    params = recipe.params
    weights: list[Setting] = (
        [1.0] * len(models) if params.weights == "uniform" else list(params.weights)
    )
    switch = params.normalize_weights
    num_layers = layer_count(inputs, recipe.method, [*weights, switch])

    def resolved(name: str, layer: int | None) -> tuple[list[float], bool]:
        at = position(layer, num_layers)
        found = []
        own = inputs.own_names(models, name)  # each model's own name of it, as mergekit's
        for i, setting in enumerate(weights):
            value = resolve(setting, name=own[i], at=at)
            if value is None:
                raise RecipeError.for_field(f"params.weights.{i}", f"no filter matches {name}")
            found.append(value)
        normalize = resolve_switch(switch, name=name, at=at)
        if normalize is None:
            raise RecipeError.for_field("params.normalize_weights", f"no filter matches {name}")
        if normalize and sum(found) == 0.0:
            raise RecipeError.for_field(
                "params.weights", f"sum to 0 for {name}: normalize_weights divides by the sum"
            )
        return found, normalize

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        found, _ = resolved(name, layer)
        made = [Term(i, w) for i, w in zip(models, found, strict=True)]
        if base is not None:  # the kernel takes the base as the last term
            made.append(Term(base, 1.0))
        return "multislerp", tuple(made), "multislerp"

    def scalars(name: str, layer: int | None) -> tuple[tuple[str, float], ...]:
        _, normalize = resolved(name, layer)
        return (("base", float(base is not None)), ("normalize_weights", float(normalize)),
                ("eps", params.eps))  # fmt: skip

    return MethodPlan(
        rule=rule,
        config_input=base if base is not None else models[0],
        tokenizer_input=base if base is not None else models[0],
        scalars=scalars,
        resolved_weights={"weights": [s if isinstance(s, float) else "varies" for s in weights]},
    )


def translate_multislerp(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """The models besides an optional base (then of their task vectors); `weight` per model,
    as written; normalize_weights shared, eps one value."""
    models = [m for m in config.inputs if not config.is_base(m)]
    if len(models) < 2:
        raise RecipeError.for_field(
            "models",
            f"mergekit's multislerp of {len(models)} model(s) besides the base merges nothing; "
            "give two or more",
        )
    translated = {"models": [m.source for m in models],
                  "params": read_parameters(config, translation, models)}  # fmt: skip
    if config.base is not None:  # a slice's sources must hold it, as mergekit checks
        translated["base"] = require_base(config).source
    return translated


METHOD = Method(
    name="multislerp",
    recipe=MultislerpRecipe,
    params=MultislerpParams,
    plan=plan_multislerp,
    summary="mergekit's multislerp: spherical interpolation of any number of models (or their "
    "task vectors) by weight, per tensor",
    formula="(cos ℓ·m + sin ℓ/ℓ·τ)·Σ wᵢ‖Vᵢ‖ (+ base), m the normalised Σ wᵢ·Vᵢ/‖Vᵢ‖, "
    "τ its tangent mean, ℓ = ‖τ‖; Vᵢ = Tᵢ (− base)",
    title="spherical interpolation of many models (mergekit's Multi-SLERP)",
    tags=("multislerp", "slerp"),
    base="optional",
    mergekit=Translation(
        names=("multislerp",),
        translate=translate_multislerp,
        parameters=(
            Parameter("weight", per_model=True, into="weights"),
            Parameter("normalize_weights", True, convert=flag, into="normalize_weights"),
            Parameter("eps", 1e-8, into="eps", varies=False),
        ),
        base_takes_per_model=False,
    ),
)
