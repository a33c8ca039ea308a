"""Task arithmetic (Ilharco et al. 2023): base + λ Σ w_i (T_i − base).

Computed in that order, as mergekit's task_arithmetic computes it (kernels.py): each delta
from the base weighted, the deltas summed in model order, divided by Σ w_i with `normalize`,
scaled by λ, added to the base.
"""

from __future__ import annotations

from engine.methods.base import Inputs, MethodPlan
from engine.plan import Op, Term, TiesSettings
from engine.recipe import TaskArithmeticRecipe


def plan_task_arithmetic(recipe: TaskArithmeticRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    q = recipe.params
    resolved = [1.0] * len(models) if q.weights == "uniform" else list(q.weights)
    made = tuple(Term(i, w) for i, w in zip(models, resolved, strict=True))

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "task_arithmetic", made, "task_arithmetic"

    return MethodPlan(
        rule=rule,
        config_input=models[0],
        tokenizer_input=models[0],
        # density 1: nothing is trimmed (the settings are TIES's shape)
        ties=TiesSettings(base, 1.0, q.lambda_, q.normalize),
        resolved_weights={"models": resolved, "lambda": q.lambda_},
    )
