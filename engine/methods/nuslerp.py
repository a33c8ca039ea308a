"""mergekit's `nuslerp`: spherical interpolation of two models by their weights, optionally of
their task vectors from a base, over the whole tensor, each row, or each column.

Per tensor: t = w₁ / (w₀ + w₁) (0.5 when |w₀ + w₁| < 1e-6); a = models[0], b = models[1], or
a − base and b − base with a base, whose result is then added to the base. For each vector v
of the tensor (the whole tensor with `nuslerp_flatten`; else each row along the last dim, or
each column along the first with `nuslerp_row_wise`), θ is the angle between a_v and b_v and
out_v = (sin((1 − t)θ)·a_v + sin(tθ)·b_v) / sin θ, or (1 − t)·a_v + t·b_v where 1 − cos²θ ≤ 1e-16.
The angles are found by angle_torch.py. Weights and both switches may vary by layer or
tensor name, as mergekit's do. With `slices`, each slice interpolates two of the models (in the
order it lists them), so slices may merge other pairs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan, layer_count
from engine.plan.model import Op, Term
from engine.schema.params import ONE_PER_MODEL
from engine.schema.parts import (
    MAX_MODELS,
    ModelsRecipe,
    Source,
    Strict,
    check_at_a_time,
    check_base_apart,
)
from engine.schema.settings import Setting, Switch, position, resolve, resolve_switch
from engine.translation.config import MergekitConfig
from engine.translation.settings import flag
from engine.translation.translators import (
    Parameter,
    Translation,
    read_parameters,
    require_base,
)

AT_A_TIME = 2  # models besides the base, each slice's with slices
ZERO_TOTAL = 1e-6  # weights summing closer to zero than this interpolate halfway, as mergekit


class NuslerpParams(Strict):
    weights: (
        Literal["uniform"]
        | Annotated[list[Setting], Field(min_length=2, max_length=MAX_MODELS), ONE_PER_MODEL]
    ) = Field(
        "uniform",
        description="one per model (mergekit's weight), t = w1 / (w0 + w1); uniform = 1.0 "
        "each: a number, a gradient across layers, or {filter, value}s",
    )
    nuslerp_flatten: Switch = Field(
        True, description="one angle for the whole tensor; false: one per row or column"
    )
    nuslerp_row_wise: Switch = Field(
        False,
        description="without flatten: one angle per column (vectors along the first "
        "dimension) instead of per row (along the last)",
    )


class NuslerpRecipe(ModelsRecipe):
    """mergekit's `nuslerp`; with `base`, of the task vectors models[i] − base."""

    method: Literal["nuslerp"]
    base: Source | None = Field(
        None, description="interpolate models[i] − base instead, and add the result to it"
    )
    models: list[Source] = Field(
        min_length=2,
        max_length=MAX_MODELS,
        description="the two models; with slices, every model a slice pairs (two each)",
    )
    params: NuslerpParams = NuslerpParams()

    @model_validator(mode="after")
    def _two_at_a_time(self) -> Self:
        check_base_apart(self)
        check_at_a_time(self, AT_A_TIME, self.method)
        weights = self.params.weights
        if isinstance(weights, list) and len(weights) != len(self.models):
            raise ValueError(
                f"params.weights has {len(weights)} entries for {len(self.models)} models"
            )
        return self


def plan_nuslerp(recipe: NuslerpRecipe, inputs: Inputs) -> MethodPlan:
    first, second = inputs.indices("model")
    base = inputs.base
    params = recipe.params
    weights: list[Setting] = [1.0, 1.0] if params.weights == "uniform" else list(params.weights)
    switches = {"nuslerp_flatten": params.nuslerp_flatten,
                "nuslerp_row_wise": params.nuslerp_row_wise}  # fmt: skip
    num_layers = layer_count(inputs, recipe.method, [*weights, *switches.values()])

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        at = position(layer, num_layers)
        w = []
        own = inputs.own_names([first, second], name)  # each model's own name, as mergekit's
        for i, setting in enumerate(weights):
            value = resolve(setting, name=own[i], at=at)
            if value is None:
                raise RecipeError.for_field(f"params.weights.{i}", f"no filter matches {name}")
            w.append(value)
        on = {}
        for field, switch in switches.items():
            found = resolve_switch(switch, name=name, at=at)
            if found is None:
                raise RecipeError.for_field(f"params.{field}", f"no filter matches {name}")
            on[field] = found
        total = w[0] + w[1]
        t = 0.5 if abs(total) < ZERO_TOTAL else w[1] / total
        op: Op = (
            "nuslerp" if on["nuslerp_flatten"]
            else "nuslerp_columns" if on["nuslerp_row_wise"]
            else "nuslerp_rows"
        )  # fmt: skip
        made = [Term(first, 1.0 - t), Term(second, t)]
        if base is not None:  # the kernels take the base as the last term
            made.append(Term(base, 1.0))
        return op, tuple(made), "nuslerp"

    return MethodPlan(
        rule=rule,
        config_input=base if base is not None else first,
        tokenizer_input=base if base is not None else first,
        resolved_weights={"weights": [s if isinstance(s, float) else "varies" for s in weights]},
    )


def translate_nuslerp(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """Two models besides an optional base (then of their task vectors; over slices, every
    model they pair); `weight` per model, as written; the switches shared, with mergekit's
    defaults."""
    models = [m for m in config.inputs if not config.is_base(m)]
    if len(models) != 2 and (config.slices is None or len(models) < 2):
        raise RecipeError.for_field(
            "models", f"mergekit's nuslerp takes two models besides the base (got {len(models)})"
        )
    params = read_parameters(config, translation, models)
    translated = {"models": [m.source for m in models], "params": params}
    if config.base is not None:  # a slice's sources must hold it, as mergekit checks
        translated["base"] = require_base(config).source
    return translated


METHOD = Method(
    name="nuslerp",
    recipe=NuslerpRecipe,
    params=NuslerpParams,
    plan=plan_nuslerp,
    summary="mergekit's nuslerp: slerp of two models (or their task vectors) by weight, "
    "per tensor, row or column",
    formula="per vector v: (sin((1−t)θ)·A_v + sin(tθ)·B_v) / sin θ, t = w₁/(w₀+w₁), "
    "A = T₀ (− base), B = T₁ (− base); + base",
    title="spherical interpolation by weight (mergekit's NuSLERP)",
    tags=("nuslerp", "slerp"),
    base="optional",
    at_a_time=AT_A_TIME,
    mergekit=Translation(
        names=("nuslerp",),
        translate=translate_nuslerp,
        parameters=(
            Parameter("weight", per_model=True, into="weights"),
            Parameter("nuslerp_flatten", True, convert=flag, into="nuslerp_flatten"),
            Parameter("nuslerp_row_wise", False, convert=flag, into="nuslerp_row_wise"),
        ),
        base_takes_per_model=False,
    ),
)
