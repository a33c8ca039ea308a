"""Model soup (Wortsman et al. 2022): a weighted average of checkpoints."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from engine.methods.base import Inputs, Method, MethodPlan, inverse_normalized, normalized, terms
from engine.plan.model import Op, Term
from engine.schema.parts import (
    MAX_MODELS,
    ModelsRecipe,
    Source,
    Strict,
    Weights,
    check_weights,
)


class SoupParams(Strict):
    weights: Weights = "uniform"


class SoupRecipe(ModelsRecipe):
    method: Literal["soup"]
    models: list[Source] = Field(min_length=2, max_length=MAX_MODELS)
    params: SoupParams = SoupParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_weights(self.params.weights, len(self.models))
        if self.base is None and self.params.weights == "magnitude":
            raise ValueError("base is required when params.weights is magnitude")
        return self

    @property
    def plans_from_weights(self) -> bool:
        return self.params.weights == "magnitude"


def plan_soup(recipe: SoupRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    weights = recipe.params.weights
    if weights == "uniform":
        resolved = [1.0 / len(models)] * len(models)
    elif weights == "magnitude":
        resolved = inverse_normalized(inputs.magnitudes(models, "params.weights"))
    else:
        resolved = normalized(weights)
    made = tuple(terms(models, resolved))

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "linear", made, "soup"

    return MethodPlan(
        rule=rule,
        config_input=models[0],
        tokenizer_input=models[0],
        resolved_weights={"models": resolved},
    )


METHOD = Method(
    name="soup",
    recipe=SoupRecipe,
    params=SoupParams,
    plan=plan_soup,
    summary="weighted average of checkpoints",
    formula="Σ wᵢ·Tᵢ, the weights normalised to sum 1",
    title="a model soup (weighted average)",
    tags=("model-soup",),
    base="optional",
)
