"""mergekit's `nearswap`: the model's values where they lie near the base's, the base's where
they are far apart, blended in between.

Per element, with a = base and b = the model: w = clamp(t / max(|a − b|, 1e-6), 0, 1) and
out = w·b + (1 − w)·a; entries closer than t take the model, farther ones lean to the base as
t/|a − b|. Elementwise (nearswap_torch.py), a chunk at a time. `t` may vary by layer (a
gradient) or tensor name (filters), as mergekit's does.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan, described, setting_scalars
from engine.plan.model import Op, Term
from engine.schema.parts import ModelsRecipe, Source, Strict, check_base_apart
from engine.schema.settings import Setting
from engine.translation.config import MergekitConfig
from engine.translation.translators import Parameter, Translation, read_parameters, task_vectors


class NearswapParams(Strict):
    t: Setting = Field(
        description="the distance below which an entry takes the model's value: a number, a "
        "gradient across layers, or {filter, value}s"
    )


class NearswapRecipe(ModelsRecipe):
    """mergekit's `nearswap`: a base and one model."""

    method: Literal["nearswap"]
    base: Source = Field(description="the model whose values are kept where the other differs")
    models: list[Source] = Field(min_length=1, max_length=1)
    params: NearswapParams

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        check_base_apart(self)
        return self


def plan_nearswap(recipe: NearswapRecipe, inputs: Inputs) -> MethodPlan:
    (model,) = inputs.indices("model")
    base = inputs.indices("base")[0]
    settings: dict[str, Setting] = {"t": recipe.params.t}
    made = (Term(base, 1.0), Term(model, 1.0))  # the kernel takes the base first

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "nearswap", made, "nearswap"

    return MethodPlan(
        rule=rule,
        config_input=base,
        tokenizer_input=base,
        scalars=setting_scalars(inputs, recipe.method, settings),
        resolved_weights=described(settings),
    )


def translate_nearswap(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """The base_model and the one other model; t as written (gradients and filters)."""
    base, models = task_vectors(config)
    if len(models) != 1:
        raise RecipeError.for_field(
            "models",
            f"mergekit's nearswap takes the base and one other model (got {len(models)} others)",
        )
    return {"base": base.source, "models": [models[0].source],
            "params": read_parameters(config, translation, models)}  # fmt: skip


METHOD = Method(
    name="nearswap",
    recipe=NearswapRecipe,
    params=NearswapParams,
    plan=plan_nearswap,
    summary="mergekit's nearswap: per element, the model where it is within t of the base, "
    "leaning to the base where farther",
    formula="w·T₀ + (1 − w)·base, w = clamp(t / max(|base − T₀|, 1e-6), 0, 1)",
    title="NearSwap (mergekit's nearswap)",
    tags=("nearswap",),
    base="required",
    pair_baseline=False,  # a base and one model, not a pair
    mergekit=Translation(
        names=("nearswap",),
        translate=translate_nearswap,
        parameters=(Parameter("t", into="t"),),
    ),
)
