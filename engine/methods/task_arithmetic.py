"""Task arithmetic (Ilharco et al. 2023): base + λ Σ w_i (T_i − base).

Linear, so it is expanded into one combination: (1 − λ Σ w_i)·base + Σ λ w_i·T_i.
"""

from __future__ import annotations

from engine.methods.base import Inputs, MethodPlan
from engine.plan import Op, Term
from engine.recipe import TaskArithmeticRecipe


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
