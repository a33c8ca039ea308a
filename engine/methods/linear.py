"""mergekit's `linear`: Σ w_i·T_i, divided by Σ w_i with `normalize` (Wortsman et al. 2022).

Unlike soup, the weights are not normalised up front: mergekit accumulates w_i·T_i with fused
multiply-adds and divides once at the end, and its bytes are matched only by doing the same.
Each weight may vary by layer (a gradient) or by tensor name (filters), as mergekit's do.
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
)
from engine.schema.settings import Setting, position, resolve
from engine.translation.config import MergekitConfig
from engine.translation.settings import flag
from engine.translation.translators import (
    Parameter,
    Translation,
    models_with_base,
    read_parameters,
)


class LinearParams(Strict):
    weights: (
        Literal["uniform"]
        | Annotated[list[Setting], Field(min_length=2, max_length=MAX_MODELS), ONE_PER_MODEL]
    ) = Field(
        "uniform",
        description="uniform = 1.0 each; or one per model: a number, a gradient across layers, "
        "or {filter, value}s",
    )
    normalize: bool = Field(True, description="divide by the sum of the weights")


class LinearRecipe(ModelsRecipe):
    """mergekit's `linear`: Σ w_i·T_i, divided by Σ w_i with `normalize`."""

    method: Literal["linear"]
    base: Source | None = Field(None, description="not used; accepted as by soup")
    models: list[Source] = Field(min_length=2, max_length=MAX_MODELS)
    params: LinearParams = LinearParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        weights = self.params.weights
        if isinstance(weights, list) and len(weights) != len(self.models):
            raise ValueError(
                f"params.weights has {len(self.params.weights)} entries for "
                f"{len(self.models)} models"
            )
        return self


def plan_linear(recipe: LinearRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    weights = recipe.params.weights
    settings: list[Setting] = [1.0] * len(models) if weights == "uniform" else list(weights)
    num_layers = layer_count(inputs, recipe.method, settings)
    op: Op = "weighted_mean" if recipe.params.normalize else "weighted_sum"

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        at = position(layer, num_layers)
        made = []
        own = inputs.own_names(models, name)  # each model's own name of it, as mergekit's
        for i, (source, setting) in enumerate(zip(models, settings, strict=True)):
            weight = resolve(setting, name=own[i], at=at)
            if weight is None:
                raise RecipeError.for_field(f"params.weights.{i}", f"no filter matches {name}")
            made.append(Term(source, weight))
        if op == "weighted_mean" and sum(t.coefficient for t in made) == 0.0:
            raise RecipeError.for_field("params.weights", f"sum to zero for {name}")
        return op, tuple(made), "linear"

    return MethodPlan(
        rule=rule,
        config_input=models[0],
        tokenizer_input=models[0],
        # not "models": that key promises one float per input (the lineage records them)
        resolved_weights={"weights": [s if isinstance(s, float) else "varies" for s in settings]},
    )


def translate_linear(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """Every model mergekit merges, a base not among them included; weights as written."""
    models = models_with_base(config)
    if len(models) < 2:
        raise RecipeError.for_field("models", "Layerswap's linear takes at least two models")
    return {"models": [m.source for m in models],
            "params": read_parameters(config, translation, models)}  # fmt: skip


METHOD = Method(
    name="linear",
    recipe=LinearRecipe,
    params=LinearParams,
    plan=plan_linear,
    summary="mergekit's linear: Σ w_i T_i (÷ Σ w_i with normalize)",
    formula="Σ wᵢ·Tᵢ, ÷ Σ wᵢ with normalize",
    title="a linear merge (weighted sum, as mergekit's linear)",
    tags=("linear",),
    base="unused",
    mergekit=Translation(
        names=("linear",),
        translate=translate_linear,
        parameters=(
            Parameter("weight", per_model=True, into="weights"),
            Parameter("normalize", True, convert=flag, into="normalize", varies=False),
        ),
    ),
)
