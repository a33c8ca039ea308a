"""mergekit's `linear`: Σ w_i·T_i, divided by Σ w_i with `normalize` (Wortsman et al. 2022).

Unlike soup, the weights are not normalised up front: mergekit accumulates w_i·T_i with fused
multiply-adds and divides once at the end, and its bytes are matched only by doing the same.
Each weight may vary by layer (a gradient) or by tensor name (filters), as mergekit's do.
"""

from __future__ import annotations

from engine.errors import RecipeError
from engine.gradients import Setting, position, resolve
from engine.methods.base import Inputs, MethodPlan, layer_count
from engine.plan import Op, Term
from engine.recipe import LinearRecipe


def plan_linear(recipe: LinearRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    weights = recipe.params.weights
    settings: list[Setting] = [1.0] * len(models) if weights == "uniform" else list(weights)
    num_layers = layer_count(inputs, recipe.method, settings)
    op: Op = "weighted_mean" if recipe.params.normalize else "weighted_sum"

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        at = position(layer, num_layers)
        made = []
        for i, (source, setting) in enumerate(zip(models, settings, strict=True)):
            weight = resolve(setting, name=name, at=at)
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
