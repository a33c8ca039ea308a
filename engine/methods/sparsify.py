"""What mergekit's sparsifying task-vector methods share: DARE, breadcrumbs and DELLA, each with
and without TIES's sign consensus, as mergekit 0.1.5's generalized task arithmetic makes them.

Per tensor, with δᵢ = Tᵢ − base for each model i (float32 throughout):

1. thin δᵢ: zero all but about a `density` fraction of its entries, chosen by the method
   (dare.py: at random; breadcrumbs.py: neither the smallest nor the largest |δᵢ|; della.py: at
   random, larger |δᵢ| likelier); with `rescale`, multiply what is kept by ‖δᵢ‖₁ / ‖kept‖₁;
2. weigh: dᵢ = wᵢ·thinned δᵢ;
3. merge: with consensus, elect the sign of Σ dᵢ per entry (zero counts as +), sum the dᵢ of
   that sign and, with `normalize`, divide by the Σ wᵢ of those (0 → 1); without consensus,
   Σ dᵢ, divided by Σ wᵢ (|Σ wᵢ| < 1e-8 → 1) with `normalize`;
4. out = base + λ·merged.

Weights and the per-model amounts (density, gamma, epsilon) may vary by layer or tensor name
(engine/schema/settings.py), as mergekit's do; they are resolved per tensor into its `Thinning`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.errors import RecipeError
from engine.methods.base import Inputs, Method, MethodPlan, ThinningRule, layer_count
from engine.plan.model import Dropping, Op, SparsifySettings, Term, Thinning
from engine.schema.params import ONE_PER_MODEL, Range, bounds
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict
from engine.schema.settings import Condition, Depth, Setting, position, resolve
from engine.translation.config import MergekitConfig
from engine.translation.settings import flag
from engine.translation.translators import (
    Parameter,
    Translation,
    fraction,
    translate_task_vectors,
)

PerModelSettings = Annotated[
    list[Setting], Field(min_length=1, max_length=MAX_MODELS), ONE_PER_MODEL
]
PerModel = float | PerModelSettings
PER_MODEL_HELP = "one number for every model, or a list with one setting per model"
MAX_SEED = 2**63 - 1


class SparsifyParams(Strict):
    model_config = ConfigDict(populate_by_name=True)
    # The per-model amounts besides the weights, each a field of this name with its Range.
    AMOUNTS: ClassVar[tuple[str, ...]] = ("density",)

    weights: Literal["uniform"] | PerModelSettings = Field(
        "uniform",
        description="uniform = 1.0 each; or one per model: a number, a gradient across layers, "
        "or {filter, value}s",
    )
    density: Annotated[PerModel, Range(0, 1, low_open=True)] = Field(
        0.5, description=f"fraction of each delta kept, in (0, 1]: {PER_MODEL_HELP}"
    )
    lambda_: Setting = Field(1.0, alias="lambda", description="scale of the merged delta")
    normalize: bool = Field(False, description="divide by the sum of the (agreeing) weights")
    rescale: bool = Field(
        False, description="scale each thinned delta back to its original L1 norm"
    )
    int8_mask: bool = Field(
        False, description="accepted as in mergekit configs; it does not change the result"
    )

    def random_seed(self) -> int | None:
        """The seed of the random drops; None for a method that drops none at random."""
        return None

    def check(self, models: int) -> None:
        """Raise ValueError naming the field of a value that fits no tensor."""
        check_per_model(self, self.weights, self.AMOUNTS, models)

    def check_tensor(self, thinning: Thinning, fields: dict[str, list[str]], name: str) -> None:
        """Raise RecipeError for amounts that do not fit together on one tensor."""


class SparsifyRecipe(ModelsRecipe):
    base: Source
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: SparsifyParams = SparsifyParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        self.params.check(len(self.models))
        return self


def check_per_model(params: BaseModel, weights: Any, amounts: Sequence[str], models: int) -> None:
    """Raise ValueError naming the field of a value of `params` that fits no tensor: its
    `weights` or an amount (a field declared with its Range) listed for another number of
    models, or an amount's number outside its Range."""
    if isinstance(weights, list) and len(weights) != models:
        raise ValueError(f"params.weights has {len(weights)} entries for {models} models")
    for amount in amounts:
        value = getattr(params, amount)
        if isinstance(value, list) and len(value) != models:
            raise ValueError(
                f"params.{amount} has {len(value)} entries for {models} models ({PER_MODEL_HELP})"
            )
        allowed = bounds(type(params).model_fields[amount])
        assert allowed is not None  # each amount is declared with its Range
        for setting, field in per_model(value, f"params.{amount}", models):
            for number in numbers(setting):
                if number not in allowed:
                    raise ValueError(f"{field} must be in {allowed} (got {number})")


def per_model(value: Any, field: str, models: int) -> list[tuple[Setting, str]]:
    """(setting, its field) for each model: a shared number, or the list's entries."""
    if isinstance(value, list):
        return [(setting, f"{field}.{i}") for i, setting in enumerate(value)]
    return [(value, field)] * models


def check_in_range(params: BaseModel, names: Sequence[str]) -> None:
    """Raise ValueError naming a setting of `params` (a field declared with its Range) that
    names a number outside its Range."""
    for name in names:
        allowed = bounds(type(params).model_fields[name])
        assert allowed is not None  # each is declared with its Range
        for number in numbers(getattr(params, name)):
            if number not in allowed:
                raise ValueError(f"params.{name} must be in {allowed} (got {number})")


def numbers(setting: Setting) -> Iterator[float]:
    """Every number a setting names: what it resolves to always lies among or between them."""
    if isinstance(setting, float | int):
        yield float(setting)
        return
    for item in setting:
        if isinstance(item, Condition):
            yield from numbers(item.value)
        else:
            yield float(item)


def plan_sparsify(
    recipe: SparsifyRecipe, inputs: Inputs, *, dropping: Dropping, consensus: bool
) -> MethodPlan:
    models = inputs.indices("model")
    base = inputs.base
    assert base is not None  # the recipe requires it
    q = recipe.params
    count = len(models)
    weights = per_model(1.0 if q.weights == "uniform" else q.weights, "params.weights", count)
    amounts = {a: per_model(getattr(q, a), f"params.{a}", count) for a in q.AMOUNTS}
    settings = [s for s, _ in weights] + [s for a in amounts.values() for s, _ in a]
    num_layers = layer_count(inputs, recipe.method, [*settings, q.lambda_])

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        own = inputs.own_names(models, name)
        resolved = resolved_values(weights, own, position(layer, num_layers))
        return "sparsify", tuple(map(Term, models, resolved)), recipe.method

    def thinning(name: str, layer: int | None) -> Thinning:
        at = position(layer, num_layers)
        own = inputs.own_names(models, name)
        found = {a: resolved_values(pairs, own, at) for a, pairs in amounts.items()}
        made = Thinning(
            densities=found["density"],
            lambda_=resolved_value(q.lambda_, "params.lambda", name, at),
            gammas=found.get("gamma", ()),
            epsilons=found.get("epsilon", ()),
        )
        q.check_tensor(made, {a: [f for _, f in pairs] for a, pairs in amounts.items()}, name)
        return made

    seed = q.random_seed()
    return MethodPlan(
        rule=rule,
        config_input=base,  # the base's config and tokenizer, as mergekit's base_model's
        tokenizer_input=base,
        sparsify=SparsifySettings(base, dropping, consensus, q.normalize, q.rescale, seed),
        thinning=thinning,
        resolved_weights=resolved_weights(weights, seed),
    )


def resolved_value(setting: Setting, field: str, name: str, at: float) -> float:
    """`setting`'s value for tensor `name` at depth `at`; a RecipeError naming `field` when no
    filter matches it."""
    found = resolve(setting, name=name, at=at)
    if found is None:
        raise RecipeError.for_field(field, f"no filter matches {name}")
    return found


def fixed_value(setting: object) -> float | None:
    """A setting's (or per-model amount's) one value where it is a plain number, else None."""
    return float(setting) if isinstance(setting, float | int) else None


def thinning_by_tensor(
    densities: Sequence[tuple[Setting, str]],
    lambda_: Setting,
    num_layers: Depth,
    own_names: Callable[[str], Sequence[str]],
) -> ThinningRule:
    """Per tensor: the models' densities (each matched against the model's own name of the
    tensor: `own_names`) and λ, resolved at its depth (TIES's and task arithmetic's amounts
    where they vary)."""

    def thinning(name: str, layer: int | None) -> Thinning:
        at = position(layer, num_layers)
        found = resolved_values(densities, own_names(name), at)
        return Thinning(found, lambda_=resolved_value(lambda_, "params.lambda", name, at))

    return thinning


def resolved_values(
    pairs: Sequence[tuple[Setting, str]], names: Sequence[str], at: float
) -> tuple[float, ...]:
    """Per model, its setting for the tensor it names `names[i]` (its own name of it)."""
    return tuple(
        resolved_value(setting, field, name, at)
        for (setting, field), name in zip(pairs, names, strict=True)
    )


def resolved_weights(weights: Sequence[tuple[Setting, str]], seed: int | None) -> dict[str, Any]:
    """What the lineage records of the weights (and the seed of the random drops)."""
    numeric = [float(s) for s, _ in weights if isinstance(s, float | int)]
    # "models" promises one float per input (the lineage records them), as ties' does
    resolved: dict[str, Any] = (
        {"models": numeric}
        if len(numeric) == len(weights)
        else {"weights": [s if isinstance(s, float | int) else "varies" for s, _ in weights]}
    )
    if seed is not None:
        resolved["seed"] = seed
    return resolved


def sparsify_method(
    *,
    name: str,
    recipe: type[SparsifyRecipe],
    params: type[SparsifyParams],
    dropping: Dropping,
    consensus: bool,
    summary: str,
    formula: str,
    title: str,
    tags: tuple[str, ...],
    mergekit: Translation,
) -> Method:
    return Method(
        name=name,
        recipe=recipe,
        params=params,
        plan=partial(plan_sparsify, dropping=dropping, consensus=consensus),
        summary=summary,
        formula=formula,
        title=title,
        tags=tags,
        base="required",
        mergekit=mergekit,
    )


def sparsifying_translation(
    name: str,
    *,
    normalize: bool,
    rescale: bool,
    amounts: dict[str, float] | None = None,
    random: bool = False,
) -> Translation:
    """mergekit's `name`, with its defaults for normalize and rescale and the amounts it takes
    per model beside weight and density (with theirs): weights and amounts per model, as
    written (gradients and filters), the switches shared; mergekit's density defaults to 1."""
    amounts = amounts or {}
    return Translation(
        names=(name,),
        translate=_translate_random if random else translate_task_vectors,
        parameters=(
            Parameter("weight", per_model=True, into="weights"),
            Parameter("density", 1.0, per_model=True, convert=fraction, into="density"),
            *(Parameter(a, default, per_model=True, into=a) for a, default in amounts.items()),
            Parameter("lambda", 1.0, into="lambda"),
            Parameter("normalize", normalize, convert=flag, into="normalize", varies=False),
            Parameter("rescale", rescale, convert=flag, into="rescale", varies=False),
            Parameter("int8_mask", False, convert=flag),
        ),
        base_takes_per_model=False,
    )


def _translate_random(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    translated = translate_task_vectors(config, translation)
    config.warnings.append(
        f"{config.method}'s drops are random: mergekit draws them from torch's generator, "
        "Layerswap from the recipe's seed (0), the same each time; the two agree in "
        "distribution, not entry by entry"
    )
    return translated


def spread_fits(density: float, epsilon: float) -> bool:
    """Whether DELLA's keep probabilities density ± epsilon lie in (0, 1), as they must
    wherever it thins (density < 1)."""
    return density >= 1.0 or (density - epsilon > 0.0 and density + epsilon < 1.0)


SPREAD_HELP = "density ± epsilon must lie in (0, 1)"
