"""Task arithmetic (Ilharco et al. 2023): base + λ Σ w_i (T_i − base).

Linear, so it is expanded into one combination: (1 − λ Σ w_i)·base + Σ λ w_i·T_i.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from engine.methods.base import Inputs, Method, MethodPlan
from engine.plan import Op, Term
from engine.recipe_parts import (
    MAX_MODELS,
    ModelsRecipe,
    Source,
    Strict,
    check_weights,
)


class TaskArithmeticParams(Strict):
    model_config = ConfigDict(populate_by_name=True)
    weights: Literal["uniform"] | Annotated[list[float], Field(max_length=MAX_MODELS)] = Field(
        "uniform", description="uniform = 1.0 each"
    )
    lambda_: float = Field(1.0, alias="lambda", description="scale of the summed task vectors")


class TaskArithmeticRecipe(ModelsRecipe):
    method: Literal["task_arithmetic"]
    base: Source
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: TaskArithmeticParams = TaskArithmeticParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_weights(self.params.weights, len(self.models))
        return self


def plan_task_arithmetic(recipe: TaskArithmeticRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    weights = recipe.params.weights
    resolved = [1.0] * len(models) if weights == "uniform" else list(weights)
    scale = recipe.params.lambda_
    made = (
        Term(base, 1.0 - scale * sum(resolved)),
        *(Term(i, scale * w) for i, w in zip(models, resolved, strict=True)),
    )

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "linear", made, "task_arithmetic"

    return MethodPlan(
        rule=rule,
        config_input=models[0],
        tokenizer_input=models[0],
        resolved_weights={"models": resolved, "lambda": scale},
    )


METHOD = Method(
    name="task_arithmetic",
    recipe=TaskArithmeticRecipe,
    params=TaskArithmeticParams,
    plan=plan_task_arithmetic,
    summary="base + λ Σ w_i (T_i − base)",
    title="task arithmetic",
    tags=("task-arithmetic",),
    base="required",
)
