"""Task arithmetic (Ilharco et al. 2023): base + λ Σ w_i (T_i − base).

Computed in that order, as mergekit's task_arithmetic computes it (torch_kernels.py): each delta
from the base weighted, the deltas summed in model order, divided by Σ w_i with `normalize`,
scaled by λ, added to the base. Weights are settings per model (a number, a gradient across the
layers, or {filter, value}s), as mergekit's are, resolved per tensor into the terms'
coefficients.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from engine.methods.base import Inputs, Method, MethodPlan, layer_count
from engine.methods.sparsify import (
    PerModelSettings,
    check_per_model,
    fixed_value,
    per_model,
    resolved_values,
    resolved_weights,
    thinning_by_tensor,
)
from engine.plan.model import Op, Term, TiesSettings
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict
from engine.schema.settings import Setting, position
from engine.translation.config import MergekitConfig
from engine.translation.settings import flag
from engine.translation.translators import (
    Parameter,
    Translation,
    set_anywhere,
    translate_task_vectors,
)


class TaskArithmeticParams(Strict):
    model_config = ConfigDict(populate_by_name=True)
    weights: Literal["uniform"] | PerModelSettings = Field(
        "uniform",
        description="uniform = 1.0 each; or one per model: a number, a gradient across layers, "
        "or {filter, value}s",
    )
    lambda_: Setting = Field(
        1.0,
        alias="lambda",
        description="scale of the summed task vectors: a number, a gradient across layers, or "
        "{filter, value}s",
    )
    normalize: bool = Field(
        False, description="divide the summed task vectors by Σ w (unless it is about 0)"
    )


class TaskArithmeticRecipe(ModelsRecipe):
    method: Literal["task_arithmetic"]
    base: Source
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: TaskArithmeticParams = TaskArithmeticParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        check_per_model(self.params, self.params.weights, (), len(self.models))
        return self


def plan_task_arithmetic(recipe: TaskArithmeticRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    q = recipe.params
    weights = per_model(1.0 if q.weights == "uniform" else q.weights, "params.weights", len(models))
    num_layers = layer_count(inputs, recipe.method, [*(s for s, _ in weights), q.lambda_])
    shared = fixed_value(q.lambda_)

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        found = resolved_values(weights, own(name), position(layer, num_layers))
        return "task_arithmetic", tuple(map(Term, models, found)), "task_arithmetic"

    # λ where it varies (nothing is trimmed: density 1 for every model)
    own = partial(inputs.own_names, models)
    thinning = thinning_by_tensor(per_model(1.0, "", len(models)), q.lambda_, num_layers, own)

    return MethodPlan(
        rule=rule,
        config_input=base,  # the base's config and tokenizer, as mergekit's base_model's
        tokenizer_input=base,
        # density 1: nothing is trimmed (the settings are TIES's shape)
        ties=TiesSettings(base, 1.0, 1.0 if shared is None else shared, q.normalize),
        thinning=thinning if shared is None else None,
        resolved_weights={
            **resolved_weights(weights, None),
            "lambda": "varies" if shared is None else shared,
        },
    )


def translate_task_arithmetic(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    translated = translate_task_vectors(config, translation)
    for name in ("density", "rescale"):
        for where in set_anywhere(config, name):
            config.warnings.append(
                f"{where}: mergekit's task_arithmetic does not sparsify, so ignores it; ignored"
            )
    return translated


METHOD = Method(
    name="task_arithmetic",
    recipe=TaskArithmeticRecipe,
    params=TaskArithmeticParams,
    plan=plan_task_arithmetic,
    summary="base + λ Σ w_i (T_i − base)",
    formula="base + λ Σ wᵢ (Tᵢ − base), ÷ Σ wᵢ inside with normalize",
    title="task arithmetic",
    tags=("task-arithmetic",),
    base="required",
    mergekit=Translation(
        names=("task_arithmetic",),
        translate=translate_task_arithmetic,
        # mergekit's generalized task arithmetic takes density and rescale here too, and
        # ignores them: nothing is sparsified
        parameters=(
            Parameter("weight", per_model=True, into="weights"),
            Parameter("density", 1.0, per_model=True),
            Parameter("lambda", 1.0, into="lambda"),
            Parameter("normalize", False, convert=flag, into="normalize", varies=False),
            Parameter("rescale", False, convert=flag),
            Parameter("int8_mask", False, convert=flag),
        ),
        base_takes_per_model=False,
    ),
)
