"""mergekit's `model_stock` (Jang et al. 2024, arXiv 2403.19522): the models' average pulled
towards the base by how much their task vectors agree.

Per tensor (per row with `filter_wise`): δᵢ = Tᵢ − base for the N models; cos θ = the mean, over
the pairs i < j, of ⟨δᵢ, δⱼ⟩ / max(‖δᵢ‖‖δⱼ‖, 1e-6) clamped to [−1, 1];
t = N cos θ / (1 + (N − 1) cos θ), or 0 where |1 + (N − 1) cos θ| < 1e-6;
out = t · (Σ Tᵢ) / N + (1 − t) · base. The angles are found by angle_torch.py.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan, layer_count
from engine.plan.model import Op, Term
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict, check_base_apart
from engine.schema.settings import Switch, position, resolve_switch
from engine.translation.config import MergekitConfig
from engine.translation.settings import flag
from engine.translation.translators import (
    Parameter,
    Translation,
    read_parameters,
    task_vectors,
)


class ModelStockParams(Strict):
    filter_wise: Switch = Field(
        False, description="one angle per row (along the last dimension) instead of per tensor"
    )


class ModelStockRecipe(ModelsRecipe):
    """mergekit's `model_stock`: a base and at least two models fine-tuned from it."""

    method: Literal["model_stock"]
    base: Source = Field(description="the model the others were fine-tuned from")
    models: list[Source] = Field(min_length=2, max_length=MAX_MODELS)
    params: ModelStockParams = ModelStockParams()

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        check_base_apart(self)
        return self


def plan_model_stock(recipe: ModelStockRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    switch = recipe.params.filter_wise
    num_layers = layer_count(inputs, recipe.method, [switch])
    # The kernels take the base as the last term; t comes from the angles, found per tensor.
    made = (*(Term(i, 1.0 / len(models)) for i in models), Term(base, 1.0))

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        rows = resolve_switch(switch, name=name, at=position(layer, num_layers))
        if rows is None:
            raise RecipeError.for_field("params.filter_wise", f"no filter matches {name}")
        return ("model_stock_rows" if rows else "model_stock"), made, "model_stock"

    return MethodPlan(rule=rule, config_input=base, tokenizer_input=base)


def translate_model_stock(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    base, models = task_vectors(config)
    if len(models) < 2:
        raise RecipeError.for_field(
            "models", "mergekit's model_stock takes at least two models besides the base"
        )
    return {"base": base.source, "models": [m.source for m in models],
            "params": read_parameters(config, translation, models)}  # fmt: skip


METHOD = Method(
    name="model_stock",
    recipe=ModelStockRecipe,
    params=ModelStockParams,
    plan=plan_model_stock,
    summary="mergekit's model_stock: the models' average, pulled to the base by the angle "
    "between their task vectors",
    formula="per vector v: t·(Σ Tᵢ,v)/N + (1 − t)·base_v, t = N cos θ / (1 + (N−1) cos θ), "
    "θ the mean angle between the task vectors",
    title="Model Stock (as mergekit's model_stock)",
    tags=("model_stock",),
    base="required",
    mergekit=Translation(
        names=("model_stock",),
        translate=translate_model_stock,
        parameters=(Parameter("filter_wise", False, convert=flag, into="filter_wise"),),
    ),
)
