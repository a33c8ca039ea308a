"""Model soup (Wortsman et al. 2022): a weighted average of checkpoints."""

from __future__ import annotations

from engine.methods.base import Inputs, MethodPlan, inverse_normalized, normalized, terms
from engine.plan import Op, Term
from engine.recipe import SoupRecipe


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
