"""TIES merging (Yadav et al. 2023) as common open-source tools formulate it.

Per tensor: δ_i = T_i − base; keep its k = ⌊density·n⌋ largest |δ_i| (at least one; of equal
|δ_i| at the cut, the first in flat order), as mergekit keeps them; weight by w_i; elect the
sign of Σ w_i·δ_i (zero counts as +); sum the entries that agree with it; with `normalize`,
divide by the Σ w_i of the agreeing entries (0 → 1); out = base + λ·sum. The arithmetic lives
in torch_kernels.py. The output takes the base's config and tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan
from engine.plan.model import Op, Term, TiesSettings
from engine.schema.params import ONE_PER_MODEL
from engine.schema.parts import (
    MAX_MODELS,
    ModelsRecipe,
    Source,
    Strict,
    check_weights,
)
from engine.translation.config import Input, MergekitConfig
from engine.translation.settings import constant, flag, number
from engine.translation.translators import (
    Parameter,
    Translation,
    read_parameter,
    task_vectors,
)


class TiesParams(Strict):
    model_config = ConfigDict(populate_by_name=True)
    weights: (
        Literal["uniform"] | Annotated[list[float], Field(max_length=MAX_MODELS), ONE_PER_MODEL]
    ) = Field("uniform", description="uniform = 1.0 each")
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
        config_input=base,  # the base's config and tokenizer, as mergekit's base_model's
        tokenizer_input=base,
        ties=TiesSettings(base, q.density, q.lambda_, q.normalize),
        resolved_weights={"models": resolved},
    )


def translate_ties(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """One positive weight per model, one density for all, no rescale."""
    base, models = task_vectors(config)
    weights = read_parameter(config, translation, "weight", models)
    for model, weight in zip(models, weights, strict=True):
        if weight <= 0:
            raise RecipeError.for_field(
                f"{model.field}.parameters.weight",
                f"{weight}: Layerswap's ties takes positive weights",
            )
    density = _density(config, models, translation.parameter("density").default)
    if read_parameter(config, translation, "rescale"):
        raise RecipeError.for_field("parameters.rescale", "Layerswap's ties does not rescale")
    params = {"weights": weights, "density": density,
              "lambda": read_parameter(config, translation, "lambda"),
              "normalize": read_parameter(config, translation, "normalize")}  # fmt: skip
    return {"base": base.source, "models": [m.source for m in models], "params": params}


def _density(config: MergekitConfig, models: list[Input], default: float) -> float:
    found: list[tuple[str, float]] = []
    for model in models:
        value = float(constant(
            config.model_chain(model, "density", number, default),
            "Layerswap's ties takes one density",
            missing=f"{model.field}.parameters.density",
        ))  # fmt: skip
        where = f"{model.field}.parameters.density"
        if value <= 0:
            raise RecipeError.for_field(where, f"{value}: must be above 0")
        found.append((where, min(value, 1.0)))  # mergekit keeps every entry from 1 up
        if found[-1][1] != found[0][1]:
            raise RecipeError.for_field(
                where, "per-model densities differ; Layerswap's ties takes one density"
            )
    return found[0][1]


METHOD = Method(
    name="ties",
    recipe=TiesRecipe,
    params=TiesParams,
    plan=plan_ties,
    summary="trim, elect sign, disjoint merge (Yadav et al. 2023)",
    formula="base + λ·Σ wᵢ·δᵢ over the entries whose sign agrees with the elected sign of "
    "Σ wᵢ·δᵢ, δᵢ = Tᵢ − base trimmed to its ⌊density·n⌋ largest |δᵢ| (÷ the agreeing Σ wᵢ "
    "with normalize)",
    title="TIES merging",
    tags=("ties",),
    base="required",
    mergekit=Translation(
        names=("ties",),
        translate=translate_ties,
        parameters=(
            Parameter("weight", per_model=True, into="weights", varies=False),
            Parameter("density", 1.0, per_model=True, into="density", varies=False),
            Parameter("lambda", 1.0, into="lambda", varies=False),
            Parameter("normalize", True, convert=flag, into="normalize", varies=False),
            Parameter("rescale", False, convert=flag, varies=False),
            Parameter("int8_mask", False, convert=flag),
        ),
        base_takes_per_model=False,
    ),
)
