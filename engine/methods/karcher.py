"""mergekit's `karcher`: the Karcher (Riemannian) mean of the models' directions on the unit
hypersphere, scaled by the mean of their norms (arXiv 2603.04972).

Per tensor, with the N models' tensors Tᵢ as flat vectors: uᵢ = Tᵢ/‖Tᵢ‖, the ones of norm above
`tol` weighted 1/N each (renormalised over them); m starts at their normalised weighted sum and
takes at most `max_iter` steps m ← cos‖τ‖·m + sin‖τ‖·τ/‖τ‖ (renormalised), τ = Σ wᵢ·θᵢ/sin θᵢ
·(uᵢ − cos θᵢ·m), θᵢ = ∠(m, uᵢ) (those below `tol` left out), stopping once ‖τ‖ < tol;
out = (Σᵢ ‖Tᵢ‖/N)·m. mergekit merges its base_model as one more model (it has no base of its
own): a translated config lists it among the models. The kernel (sphere_torch.py) holds a
tensor whole when each input fits in a chunk (its N inputs, their unit vectors and a few
temporaries: about 2·N + 4 times the tensor in float32), else reads it twice, a chunk of each
input at a time (its Gram matrix, then the output).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan
from engine.plan.model import Op, Term
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict
from engine.translation.config import MergekitConfig
from engine.translation.translators import (
    Parameter,
    Translation,
    models_with_base,
    read_parameters,
)


class KarcherParams(Strict):
    max_iter: int = Field(10, ge=0, le=100_000, description="the most descent steps per tensor")
    tol: float = Field(
        1e-5, ge=0, description="stop once a step is shorter; smaller norms and angles count as 0"
    )


class KarcherRecipe(ModelsRecipe):
    """mergekit's `karcher`: every model weighs the same."""

    method: Literal["karcher"]
    base: Source | None = Field(
        None, description="not used (mergekit merges its base_model as one more model)"
    )
    models: list[Source] = Field(min_length=2, max_length=MAX_MODELS)
    params: KarcherParams = KarcherParams()


def plan_karcher(recipe: KarcherRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    made = tuple(Term(i, 1.0 / len(models)) for i in models)
    scalars = (("max_iter", float(recipe.params.max_iter)), ("tol", recipe.params.tol))

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "karcher", made, "karcher"

    return MethodPlan(
        rule=rule,
        config_input=models[0],
        tokenizer_input=models[0],
        scalars=lambda name, layer: scalars,
        resolved_weights={"models": [t.coefficient for t in made]},
    )


def translate_karcher(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """Every model the config merges, its base_model last when not among them (as mergekit
    adds it); max_iter and tol, one value each."""
    models = models_with_base(config)
    if len(models) < 2:
        raise RecipeError.for_field(
            "models", f"mergekit's karcher of {len(models)} model merges nothing; give two or more"
        )
    params = read_parameters(config, translation, models)
    if params["max_iter"] != int(params["max_iter"]):
        raise RecipeError.for_field("parameters.max_iter", "must be a whole number")
    params["max_iter"] = int(params["max_iter"])
    return {"models": [m.source for m in models], "params": params}


METHOD = Method(
    name="karcher",
    recipe=KarcherRecipe,
    params=KarcherParams,
    plan=plan_karcher,
    summary="mergekit's karcher: the Karcher mean of the models' directions on the unit "
    "sphere, per tensor, scaled by their mean norm",
    formula="(Σ ‖Tᵢ‖/N)·m, m the Karcher mean of Tᵢ/‖Tᵢ‖ (≤ max_iter steps, to tol)",
    title="the Karcher mean on the hypersphere (mergekit's karcher)",
    tags=("karcher",),
    base="unused",
    mergekit=Translation(
        names=("karcher",),
        translate=translate_karcher,
        parameters=(
            Parameter("max_iter", 10, into="max_iter", varies=False),
            Parameter("tol", 1e-5, into="tol", varies=False),
        ),
    ),
)
