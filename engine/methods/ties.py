"""TIES merging (Yadav et al. 2023) as common open-source tools formulate it.

Per tensor: δ_i = T_i − base; keep the top `density` fraction of |δ_i| (ties at the
threshold are kept); weight by w_i; elect the sign of Σ w_i·δ_i (zero counts as +);
sum the entries that agree with it; with `normalize`, divide by the Σ w_i of the agreeing
entries (0 → 1); out = base + λ·sum. The arithmetic lives in torch_kernels.py.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from engine.methods.base import Inputs, Method, MethodPlan
from engine.plan.model import Op, Term, TiesSettings
from engine.schema.parts import (
    MAX_MODELS,
    ModelsRecipe,
    Source,
    Strict,
    check_weights,
)


class TiesParams(Strict):
    model_config = ConfigDict(populate_by_name=True)
    weights: Literal["uniform"] | Annotated[list[float], Field(max_length=MAX_MODELS)] = Field(
        "uniform", description="uniform = 1.0 each"
    )
    density: float = Field(0.5, gt=0, le=1, description="fraction of each delta kept")
    lambda_: float = Field(1.0, alias="lambda", description="scale of the merged delta")
    normalize: bool = True


class TiesRecipe(ModelsRecipe):
    method: Literal["ties"]
    base: Source
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: TiesParams = TiesParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_weights(self.params.weights, len(self.models), positive=True)
        return self


def plan_ties(recipe: TiesRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    q = recipe.params
    resolved = [1.0] * len(models) if q.weights == "uniform" else list(q.weights)
    made = tuple(Term(i, w) for i, w in zip(models, resolved, strict=True))

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "ties", made, "ties"

    return MethodPlan(
        rule=rule,
        config_input=models[0],
        tokenizer_input=models[0],
        ties=TiesSettings(base, q.density, q.lambda_, q.normalize),
        resolved_weights={"models": resolved},
    )


METHOD = Method(
    name="ties",
    recipe=TiesRecipe,
    params=TiesParams,
    plan=plan_ties,
    summary="trim, elect sign, disjoint merge (Yadav et al. 2023)",
    title="TIES merging",
    tags=("ties",),
    base="required",
)
