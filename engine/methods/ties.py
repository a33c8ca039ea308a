"""TIES merging (Yadav et al. 2023) as common open-source tools formulate it.

Per tensor: δ_i = T_i − base; keep the top `density` fraction of |δ_i| (ties at the
threshold are kept); weight by w_i; elect the sign of Σ w_i·δ_i (zero counts as +);
sum the entries that agree with it; with `normalize`, divide by the Σ w_i of the agreeing
entries (0 → 1); out = base + λ·sum. The arithmetic lives in kernels.py.
"""

from __future__ import annotations

from engine.methods.base import Inputs, MethodPlan
from engine.plan import Op, Term, TiesSettings
from engine.recipe import TiesRecipe


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
