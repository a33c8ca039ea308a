"""mergekit's `sce` (Select, Calculate, Erase; arXiv 2408.07990): task vectors kept where the
models vary most, weighted by their energy, merged where they agree in sign.

Per tensor, with δᵢ = Tᵢ − base for the N models: with `select_topk` below 1, every δᵢ keeps
only the entries whose variance across the models is among the select_topk fraction (of the
nonzero variances) largest; wᵢ = mean(δᵢ²) / Σⱼ mean(δⱼ²) (1/N each where that sum is below
1e-6, as mergekit's); per entry the sign of Σ δᵢ is elected and out = base + Σ wᵢ·δᵢ / Σ wᵢ
over the δᵢ of that sign. mergekit 0.1.5's sce has no per-model weights. The kernel
(sce_torch.py) holds a tensor whole when each input fits in a chunk (its N deltas and a few
stacks of them: about 4·N times the tensor in float32), else reads it a chunk at a time,
several times (the selection, the weights, the output); it selects from the variances held at
once for a tensor of up to 8 chunks (the very entries torch.topk keeps: std_select.py), by
histograms for a larger one. `select_topk` may vary by layer or tensor name, as mergekit's
does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import Field, model_validator

from engine.methods.base import Inputs, Method, MethodPlan, described, setting_scalars
from engine.methods.sparsify import check_in_range
from engine.plan.model import Op, Term
from engine.schema.params import Range
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict, check_base_apart
from engine.schema.settings import Setting
from engine.translation.settings import flag, number
from engine.translation.translators import Parameter, Translation, translate_task_vectors


class SceParams(Strict):
    select_topk: Annotated[Setting, Range(0, 1)] = Field(
        1.0,
        description="the fraction of entries kept, those whose deltas vary most across the "
        "models (1: all): a number in [0, 1], a gradient across layers, or {filter, value}s",
    )
    int8_mask: bool = Field(
        False, description="accepted as in mergekit configs; it does not change the result"
    )

    @model_validator(mode="after")
    def _in_range(self) -> Self:
        check_in_range(self, ["select_topk"])
        return self


class SceRecipe(ModelsRecipe):
    """mergekit's `sce`: a base and the models fine-tuned from it."""

    method: Literal["sce"]
    base: Source = Field(description="the model the others' task vectors are taken from")
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: SceParams = SceParams()

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        check_base_apart(self)
        return self


def plan_sce(recipe: SceRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    settings: dict[str, Setting] = {"select_topk": recipe.params.select_topk}
    # the kernel takes the base as the last term; the weights come from the deltas
    made = (*(Term(i, 1.0) for i in models), Term(base, 1.0))

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "sce", made, "sce"

    return MethodPlan(
        rule=rule,
        config_input=base,
        tokenizer_input=base,
        scalars=setting_scalars(inputs, recipe.method, settings),
        resolved_weights=described(settings),
    )


def clipped_fraction(value: Any, field: str) -> float:
    """select_topk as mergekit reads it: at or below 0 keeps nothing, 1 and above everything."""
    return min(max(number(value, field), 0.0), 1.0)


METHOD = Method(
    name="sce",
    recipe=SceRecipe,
    params=SceParams,
    plan=plan_sce,
    summary="mergekit's sce: task vectors kept where the models vary most, weighted by their "
    "mean square, merged where they agree in sign",
    formula="base + Σ wᵢ·δᵢ / Σ wᵢ over the δᵢ = Tᵢ − base of the elected sign, top-variance "
    "entries kept, wᵢ ∝ mean(δᵢ²)",
    title="SCE: select, calculate, erase (mergekit's sce)",
    tags=("sce",),
    base="required",
    mergekit=Translation(
        names=("sce",),
        translate=translate_task_vectors,
        parameters=(
            Parameter("select_topk", 1.0, convert=clipped_fraction, into="select_topk"),
            Parameter("int8_mask", False, convert=flag),
        ),
    ),
)
