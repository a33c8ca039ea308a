"""mergekit's `arcee_fusion`: the base, with the model's values where its change from the base
matters most.

Per tensor, rows along its last dimension: importance = |T₀ − base| · KL(p ‖ q) of the row, p
and q the softmax of the model's and the base's row (+ 1e-8 each); the entries whose importance
is at least median + 1.5·(q₃ − q₁) of the tensor's importances take the model's value:
out = base + (T₀ − base)·[importance ≥ threshold]. The kernel (fusion_torch.py) reads the
tensor twice, a block of rows at a time, and holds a KL per row and the importances the
quantiles are taken of (at most a fixed sample of a million, as mergekit samples that many).
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan
from engine.plan.model import Op, Term
from engine.schema.parts import ModelsRecipe, Source, Strict, check_base_apart
from engine.translation.config import MergekitConfig
from engine.translation.translators import Translation, task_vectors


class ArceeFusionParams(Strict):
    """No params: the threshold follows from the tensor."""


class ArceeFusionRecipe(ModelsRecipe):
    """mergekit's `arcee_fusion`: a base and one model."""

    method: Literal["arcee_fusion"]
    base: Source = Field(description="the model whose values are kept where the change is small")
    models: list[Source] = Field(min_length=1, max_length=1)
    params: ArceeFusionParams = ArceeFusionParams()

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        check_base_apart(self)
        return self


def plan_arcee_fusion(recipe: ArceeFusionRecipe, inputs: Inputs) -> MethodPlan:
    (model,) = inputs.indices("model")
    base = inputs.indices("base")[0]
    made = (Term(base, 1.0), Term(model, 1.0))  # the kernel takes the base first

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "arcee_fusion", made, "arcee_fusion"

    return MethodPlan(rule=rule, config_input=base, tokenizer_input=base)


def translate_arcee_fusion(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """The base_model and the one other model."""
    base, models = task_vectors(config)
    if len(models) != 1:
        raise RecipeError.for_field(
            "models",
            f"mergekit's arcee_fusion takes the base and one other model (got {len(models)} "
            "others)",
        )
    return {"base": base.source, "models": [models[0].source]}


METHOD = Method(
    name="arcee_fusion",
    recipe=ArceeFusionRecipe,
    params=ArceeFusionParams,
    plan=plan_arcee_fusion,
    summary="mergekit's arcee_fusion: the base, with the model's values where their change "
    "(times the row's KL divergence) is an outlier",
    formula="base + (T₀ − base)·[I ≥ median(I) + 1.5·IQR(I)], I = |T₀ − base|·KL(softmax T₀ "
    "‖ softmax base) per row",
    title="Arcee Fusion (mergekit's arcee_fusion)",
    tags=("arcee_fusion",),
    base="required",
    pair_baseline=False,  # a base and one model, not a pair
    mergekit=Translation(
        names=("arcee_fusion",), translate=translate_arcee_fusion, writes="float32"
    ),
)
