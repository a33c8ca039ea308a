"""mergekit's `ram` and `ramplus_tl` (Reinforced Agent Merging, arXiv 2601.13572): task vectors
added whole where only one model changes an entry, averaged where several do.

Per tensor, with δᵢ = Tᵢ − base: an entry of δᵢ takes part where |δᵢ| > epsilon, and c models
take part there; out = base + Σᵢ (δᵢ·λᵢ where c = 1, δᵢ / c where c > 1). ram: λᵢ = 1.
ramplus_tl rewards a model whose changes overlap the others': λᵢ = 1 + r·clamp(ρᵢ, 0, alpha),
ρᵢ = (its entries shared with others) / (its entries no other changes), counted over the whole
tensor. The kernel (ram_torch.py) is elementwise, after one counting pass for ramplus_tl.
epsilon, r and alpha may vary by layer (gradients) or tensor name (filters), as mergekit's do.
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
from engine.translation.translators import Parameter, Translation, translate_task_vectors

EPSILON_HELP = "|δ| at or below it does not take part"
SETTING_HELP = "a number, a gradient across layers, or {filter, value}s"


class RamParams(Strict):
    epsilon: Annotated[Setting, Range(0, None)] = Field(
        1e-5, description=f"{EPSILON_HELP}: {SETTING_HELP}"
    )

    @model_validator(mode="after")
    def _in_range(self) -> Self:
        check_in_range(self, list(type(self).model_fields))
        return self


class RamPlusParams(RamParams):
    r: Annotated[Setting, Range(0, None)] = Field(
        0.1, description=f"how much overlap raises a model's unique entries: {SETTING_HELP}"
    )
    alpha: Annotated[Setting, Range(0, None)] = Field(
        0.2, description=f"the most the overlap ratio counts: {SETTING_HELP}"
    )


class RamRecipe(ModelsRecipe):
    """mergekit's `ram`: a base and the models fine-tuned from it."""

    method: Literal["ram"]
    base: Source = Field(description="the model the others' task vectors are taken from")
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: RamParams = RamParams()

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        check_base_apart(self)
        return self


class RamPlusRecipe(RamRecipe):
    """mergekit's `ramplus_tl`: ram with each model's unique entries scaled by its overlap."""

    method: Literal["ramplus_tl"]  # type: ignore[assignment]
    params: RamPlusParams = RamPlusParams()


OPS: dict[str, Op] = {"ram": "ram", "ramplus_tl": "ramplus_tl"}


def plan_ram(recipe: RamRecipe, inputs: Inputs) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    settings: dict[str, Setting] = dict(recipe.params)
    made = (*(Term(i, 1.0) for i in models), Term(base, 1.0))  # the kernel takes the base last
    op: Op = OPS[recipe.method]

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return op, made, op

    return MethodPlan(
        rule=rule,
        config_input=base,
        tokenizer_input=base,
        scalars=setting_scalars(inputs, recipe.method, settings),
        resolved_weights=described(settings),
    )


def _method(
    name: Literal["ram", "ramplus_tl"], recipe: type[RamRecipe], **described: Any
) -> Method:
    params = RamPlusParams if recipe is RamPlusRecipe else RamParams
    return Method(
        name=name,
        recipe=recipe,
        params=params,
        plan=plan_ram,
        tags=(name,),
        base="required",
        mergekit=Translation(
            names=(name,),
            translate=translate_task_vectors,
            parameters=tuple(
                Parameter(key, field.default, into=key)
                for key, field in params.model_fields.items()
            ),
            # ramplus_tl's λ is float32, so mergekit's result is (engine/plan/arithmetic.py)
            writes="float32" if name == "ramplus_tl" else None,
        ),
        **described,
    )


RAM = _method(
    "ram",
    RamRecipe,
    summary="mergekit's ram: each model's changes added whole where it alone changes an entry, "
    "averaged where several do",
    formula="base + Σᵢ (δᵢ where cₑ = 1, δᵢ / cₑ where cₑ > 1) over the |δᵢ| > epsilon, "
    "δᵢ = Tᵢ − base, cₑ the number of models changing entry e",
    title="Reinforced Agent Merging (mergekit's ram)",
)
RAMPLUS_TL = _method(
    "ramplus_tl",
    RamPlusRecipe,
    summary="mergekit's ramplus_tl: ram, each model's unique changes scaled up by how much of "
    "its change the others share",
    formula="base + Σᵢ (λᵢ·δᵢ where cₑ = 1, δᵢ / cₑ where cₑ > 1) over the |δᵢ| > epsilon, "
    "λᵢ = 1 + r·clamp(sharedᵢ / uniqueᵢ, 0, alpha) per tensor",
    title="Reinforced Agent Merging Plus, tensor-local (mergekit's ramplus_tl)",
)
