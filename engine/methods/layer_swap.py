"""Layer swapping (Bandarkar et al. 2025, Algorithm 1 with its 'or' read as 'and').

Bottom and top layers come from the language expert, the middle from the task expert, with
optional transition layers that average the two. Several experts of one role are first souped;
coefficients multiply through so everything stays one linear combination per tensor.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import (
    Inputs,
    Method,
    MethodPlan,
    inverse_normalized,
    normalized,
    terms,
)
from engine.plan.model import Op, Term
from engine.schema.parts import (
    MAX_EXPERTS_PER_ROLE,
    NamedSource,
    RecipeBase,
    Source,
    Strict,
)


class RoleWeights(Strict):
    task: float = Field(ge=0)
    language: float = Field(ge=0)

    @model_validator(mode="after")
    def _positive(self) -> Self:
        if self.task + self.language <= 0:
            raise ValueError("task and language weights must not both be zero")
        return self


class Experts(Strict):
    task: list[Source] = Field(min_length=1, max_length=MAX_EXPERTS_PER_ROLE)
    language: list[Source] = Field(min_length=1, max_length=MAX_EXPERTS_PER_ROLE)


class LayerSwapParams(Strict):
    bottom: int = Field(5, ge=0, description="layers from the language expert at the bottom")
    top: int = Field(2, ge=0, description="layers from the language expert at the top")
    bottom_transition: int = Field(0, ge=0, description="averaged layers above the bottom")
    top_transition: int = Field(0, ge=0, description="averaged layers below the top")
    transition_weights: Literal["uniform", "magnitude"] | RoleWeights = "uniform"
    non_layer: Literal["average", "task", "language"] = "average"
    towers: Literal["average", "task", "language"] = Field(
        "average",
        description="what a multimodal model's vision/audio towers and projectors get; the "
        "layer plan applies to the language model only",
    )
    expert_soup: Literal["uniform", "magnitude"] = "uniform"


class LayerSwapRecipe(RecipeBase):
    method: Literal["layer_swap"]
    experts: Experts
    params: LayerSwapParams = LayerSwapParams()

    @model_validator(mode="after")
    def _needs_base(self) -> Self:
        if self.base is None and self.params.transition_weights == "magnitude":
            raise ValueError("base is required when params.transition_weights is magnitude")
        if self.base is None and self.params.expert_soup == "magnitude":
            raise ValueError("base is required when params.expert_soup is magnitude")
        return self

    def sources(self) -> list[NamedSource]:
        named = [NamedSource(f"experts.{role}.{i}", f"{role}[{i}]", role, s)
                 for role, items in (("task", self.experts.task),
                                     ("language", self.experts.language))
                 for i, s in enumerate(items)]  # fmt: skip
        return self._with_base(named)

    @property
    def plans_from_weights(self) -> bool:
        return "magnitude" in (self.params.transition_weights, self.params.expert_soup)


def region(layer: int, num_layers: int, p: LayerSwapRecipe) -> str:
    """Which part of the swap a layer belongs to: language, transition or task."""
    q = p.params
    if layer < q.bottom:
        return "language"
    if layer < q.bottom + q.bottom_transition:
        return "transition"
    if layer < num_layers - q.top - q.top_transition:
        return "task"
    if layer < num_layers - q.top:
        return "transition"
    return "language"


def check_fits(recipe: LayerSwapRecipe, num_layers: int) -> None:
    q = recipe.params
    used = q.bottom + q.bottom_transition + q.top_transition + q.top
    if used > num_layers:
        raise RecipeError.for_field(
            "params",
            f"bottom + bottom_transition + top_transition + top = {used} exceeds the "
            f"{num_layers} layers of the model",
        )


def _expert_soup(q: LayerSwapParams, inputs: Inputs, indices: list[int]) -> list[float]:
    """The weights of one role's experts: by magnitude (`expert_soup: magnitude`), else equal."""
    if q.expert_soup == "magnitude" and len(indices) > 1:
        return inverse_normalized(inputs.magnitudes(indices, "params.expert_soup"))
    return [1.0 / len(indices)] * len(indices)


def _transition_weights(
    q: LayerSwapParams,
    inputs: Inputs,
    *,
    task: list[int],
    language: list[int],
    task_soup: list[float],
    language_soup: list[float],
) -> tuple[float, float]:
    """(task, language) weights of the transition layers. By magnitude, a role's magnitude is
    its experts' weighted by its soup."""
    if q.transition_weights == "uniform":
        return 0.5, 0.5
    if q.transition_weights == "magnitude":
        m = inputs.magnitudes(task + language, "params.transition_weights")
        m_task = sum(s * x for s, x in zip(task_soup, m[: len(task)], strict=True))
        m_language = sum(s * x for s, x in zip(language_soup, m[len(task) :], strict=True))
        w_task, w_language = inverse_normalized([m_task, m_language])
        return w_task, w_language
    w_task, w_language = normalized([q.transition_weights.task, q.transition_weights.language])
    return w_task, w_language


def plan_layer_swap(recipe: LayerSwapRecipe, inputs: Inputs) -> MethodPlan:
    # Never a layer stack taken for non-layer tensors (a vision tower follows `towers`).
    stacks = [checkpoint.require_layers(recipe.method) for checkpoint in inputs.checkpoints]
    q = recipe.params
    num_layers = stacks[0].count
    check_fits(recipe, num_layers)
    task, language = inputs.indices("task"), inputs.indices("language")
    task_soup, language_soup = _expert_soup(q, inputs, task), _expert_soup(q, inputs, language)
    w_task, w_language = _transition_weights(
        q, inputs, task=task, language=language, task_soup=task_soup, language_soup=language_soup
    )

    def mix(scale_task: float, scale_language: float) -> tuple[Term, ...]:
        return tuple(
            terms(task, task_soup, scale_task) + terms(language, language_soup, scale_language)
        )

    made = {
        "task": mix(1.0, 0.0),
        "language": mix(0.0, 1.0),
        "transition": mix(w_task, w_language),
        "average": mix(0.5, 0.5),
    }

    stack = stacks[task[0]]  # the config's: names its towers

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        if layer is not None:
            origin = region(layer, num_layers, recipe)
            return "linear", made[origin], origin
        if stack.in_tower(name):
            return "linear", made[q.towers], f"tower: {q.towers}"
        return "linear", made[q.non_layer], q.non_layer

    return MethodPlan(
        rule=rule,
        config_input=task[0],
        tokenizer_input=language[0],
        resolved_weights={
            "task_soup": task_soup,
            "language_soup": language_soup,
            "transition": {"task": w_task, "language": w_language},
        },
    )


METHOD = Method(
    name="layer_swap",
    recipe=LayerSwapRecipe,
    params=LayerSwapParams,
    plan=plan_layer_swap,
    summary="bottom/top layers from the language expert, the middle from the task expert",
    formula="layers [0, bottom) and [L − top, L): the language experts' soup; the transition "
    "layers next to them: w_task·task soup + w_language·language soup; the layers between: "
    "the task experts' soup; other tensors: per non_layer and towers",
    title="layer swapping (Bandarkar et al., 2025, arXiv:2410.01335)",
    tags=("layer-swapping",),
    base="optional",
    inputs="experts",
    pair_baseline=False,
)
