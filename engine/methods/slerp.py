"""Spherical linear interpolation between two models, tensor by tensor, as mergekit's `slerp`.

Per tensor: a = models[0], b = models[1], θ the angle between them as flat vectors;
out = sin((1 − t)θ)/sin θ · a + sin(tθ)/sin θ · b, or (1 − t)·a + t·b when |cos θ| > 0.9995.
θ needs the whole tensor, so the kernel reads it once for norms and dot before writing
(torch_kernels.py). `t` may vary by layer (a gradient) or tensor name (filters), as mergekit's does.
With `slices`, each slice interpolates two of the models, the one listed first in `models` at
t = 0 (mergekit's base_model, which every slice names): slices may pair models[0] with others.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan, layer_count
from engine.plan.model import Op, Term
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict, check_at_a_time
from engine.schema.settings import Setting, position, resolve
from engine.translation.config import MergekitConfig
from engine.translation.translators import (
    Parameter,
    Translation,
    models_with_base,
    read_parameters,
    require_base,
)

AT_A_TIME = 2  # models, each slice's with slices


class SlerpParams(Strict):
    t: Setting = Field(
        0.5,
        description="0 = models[0], 1 = models[1]: a number, a gradient across layers "
        "([0, 0.5, 1]) or {filter, value}s (filter: self_attn, mlp, ...)",
    )


class SlerpRecipe(ModelsRecipe):
    """mergekit's `slerp`, with models[0] as its base_model."""

    method: Literal["slerp"]
    base: Source | None = Field(None, description="not used; accepted as by soup")
    models: list[Source] = Field(
        min_length=2,
        max_length=MAX_MODELS,
        description="the two models, models[0] at t = 0; with slices, each slice's two (the "
        "one listed first here at t = 0)",
    )
    params: SlerpParams = SlerpParams()

    @model_validator(mode="after")
    def _two_at_a_time(self) -> Self:
        check_at_a_time(self, AT_A_TIME, self.method)
        return self


def plan_slerp(recipe: SlerpRecipe, inputs: Inputs) -> MethodPlan:
    first, second = inputs.indices("model")
    setting = recipe.params.t
    num_layers = layer_count(inputs, recipe.method, [setting])

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        t = resolve(setting, name=name, at=position(layer, num_layers))
        if t is None:
            raise RecipeError.for_field("params.t", f"no filter matches {name}")
        return "slerp", (Term(first, 1.0 - t), Term(second, t)), "slerp"

    return MethodPlan(
        rule=rule,
        config_input=first,
        tokenizer_input=first,
        resolved_weights={"t": setting if isinstance(setting, float) else "varies"},
    )


def translate_slerp(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """mergekit's base_model first (t = 0), the one other model second; over slices, every
    other model their slices pair the base with."""
    base = require_base(config)
    others = [m for m in models_with_base(config) if not config.is_base(m)]
    if len(others) != 1 and (config.slices is None or not others):
        raise RecipeError.for_field(
            "models",
            f"mergekit's slerp takes the base and one other model (got {len(others)} others)",
        )
    return {"models": [base.source, *(m.source for m in others)],
            "params": read_parameters(config, translation, [])}  # fmt: skip


METHOD = Method(
    name="slerp",
    recipe=SlerpRecipe,
    params=SlerpParams,
    plan=plan_slerp,
    summary="spherical interpolation of two models by t, per tensor",
    formula="sin((1−t)θ)/sin θ·T₀ + sin(tθ)/sin θ·T₁, θ the angle between T₀ and T₁",
    title="spherical linear interpolation (SLERP)",
    tags=("slerp",),
    base="unused",
    first_model_is_base=True,
    at_a_time=AT_A_TIME,
    mergekit=Translation(
        names=("slerp",), translate=translate_slerp, parameters=(Parameter("t", into="t"),)
    ),
)
