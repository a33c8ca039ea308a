"""TIES merging (Yadav et al. 2023) as common open-source tools formulate it.

Per tensor: δ_i = T_i − base; keep its k = ⌊density_i·n⌋ largest |δ_i| (at least one; of equal
|δ_i| at the cut, the first in flat order), as mergekit keeps them; weight by w_i; elect the
sign of Σ w_i·δ_i (zero counts as +); sum the entries that agree with it; with `normalize`,
divide by the Σ w_i of the agreeing entries (0 → 1); out = base + λ·sum. The arithmetic lives
in torch_kernels.py. The output takes the base's config and tokenizer.

Weights and densities are settings per model (a number, a gradient across the layers, or
{filter, value}s), as mergekit's are, resolved per tensor: the weights into the terms'
coefficients (0 and negative ones too, as mergekit takes them), the densities into the tensor's
Thinning where they are not one number for all. The kernels are TIES's own either way: routed
through the sparsifying methods' machinery, the common case would lose its compiled kernel.

With `rescale` (mergekit's parameter, off by default), each trimmed δ_i is multiplied by
‖δ_i‖₁ / ‖trimmed δ_i‖₁ before it is weighted (unscaled where either norm is below 1e-7, as
mergekit leaves it). Both norms are sums over the whole tensor, taken before its first output
byte, so such a plan is routed through the sparsifying methods' kernels (op `sparsify`,
dropping `magnitude`: the same exact top-k, with sign consensus), which sum them exactly.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from engine.methods.base import Inputs, Method, MethodPlan, layer_count
from engine.methods.sparsify import (
    PER_MODEL_HELP,
    PerModel,
    PerModelSettings,
    check_per_model,
    fixed_value,
    per_model,
    resolved_values,
    resolved_weights,
    thinning_by_tensor,
)
from engine.plan.model import Op, SparsifySettings, Term, TiesSettings
from engine.schema.params import Range
from engine.schema.parts import MAX_MODELS, ModelsRecipe, Source, Strict
from engine.schema.settings import Setting, position
from engine.translation.config import MergekitConfig
from engine.translation.settings import flag
from engine.translation.translators import (
    Parameter,
    Translation,
    fraction,
    translate_task_vectors,
)


class TiesParams(Strict):
    model_config = ConfigDict(populate_by_name=True)
    AMOUNTS: ClassVar[tuple[str, ...]] = ("density",)

    weights: Literal["uniform"] | PerModelSettings = Field(
        "uniform",
        description="uniform = 1.0 each; or one per model: a number, a gradient across layers, "
        "or {filter, value}s",
    )
    density: Annotated[PerModel, Range(0, 1, low_open=True)] = Field(
        0.5, description=f"fraction of each delta kept, in (0, 1]: {PER_MODEL_HELP}"
    )
    lambda_: Setting = Field(
        1.0,
        alias="lambda",
        description="scale of the merged delta: a number, a gradient across layers, or "
        "{filter, value}s",
    )
    normalize: bool = True
    rescale: bool = Field(
        False, description="scale each trimmed delta back to its original L1 norm"
    )

    @model_serializer(mode="wrap")
    def _written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without `rescale` where it is off: recipes written before it was a field keep
        their digests."""
        data: dict[str, Any] = handler(self)
        if not self.rescale:
            data.pop("rescale", None)
        return data


class TiesRecipe(ModelsRecipe):
    method: Literal["ties"]
    base: Source
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: TiesParams = TiesParams()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        q = self.params
        check_per_model(q, q.weights, q.AMOUNTS, len(self.models))
        return self


def plan_ties(recipe: TiesRecipe, inputs: Inputs) -> MethodPlan:
    """Weights, densities and λ resolved per tensor where they vary; a density and λ shared by
    every model and tensor stay in TiesSettings alone (no per-tensor thinning). With rescale,
    every tensor is a `sparsify` one (its thinning always resolved)."""
    models = inputs.indices("model")
    base = inputs.indices("base")[0]
    q = recipe.params
    count = len(models)
    weights = per_model(1.0 if q.weights == "uniform" else q.weights, "params.weights", count)
    densities = per_model(q.density, "params.density", count)
    settings = [s for s, _ in weights + densities]
    num_layers = layer_count(inputs, recipe.method, [*settings, q.lambda_])
    op: Op = "sparsify" if q.rescale else "ties"

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        found = resolved_values(weights, own(name), position(layer, num_layers))
        return op, tuple(map(Term, models, found)), "ties"

    own = partial(inputs.own_names, models)
    thinning = thinning_by_tensor(densities, q.lambda_, num_layers, own)
    resolved = resolved_weights(weights, None)
    if q.rescale:
        return MethodPlan(
            rule=rule,
            config_input=base,
            tokenizer_input=base,
            sparsify=SparsifySettings(base, "magnitude", True, q.normalize, True, None),
            thinning=thinning,
            resolved_weights=resolved,
        )
    density, lambda_ = fixed_value(q.density), fixed_value(q.lambda_)
    fixed = density is not None and lambda_ is not None
    return MethodPlan(
        rule=rule,
        config_input=base,  # the base's config and tokenizer, as mergekit's base_model's
        tokenizer_input=base,
        ties=TiesSettings(base, density or 1.0, 1.0 if lambda_ is None else lambda_, q.normalize),
        thinning=None if fixed else thinning,
        resolved_weights=resolved,
    )


def translate_ties(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """Weights and densities per model, as written (gradients and filters); one density for
    every model where they all write the same number; rescale only where it is on (the
    recipe's default is off, as mergekit's)."""
    translated = translate_task_vectors(config, translation)
    params = translated["params"]
    if not params.get("rescale"):
        params.pop("rescale", None)
    density = params["density"]
    if all(isinstance(d, float | int) for d in density) and len(set(density)) == 1:
        params["density"] = density[0]
    return translated


METHOD = Method(
    name="ties",
    recipe=TiesRecipe,
    params=TiesParams,
    plan=plan_ties,
    summary="trim, elect sign, disjoint merge (Yadav et al. 2023)",
    formula="base + λ·Σ wᵢ·δᵢ over the entries whose sign agrees with the elected sign of "
    "Σ wᵢ·δᵢ, δᵢ = Tᵢ − base trimmed to its ⌊densityᵢ·n⌋ largest |δᵢ| (÷ the agreeing Σ wᵢ "
    "with normalize)",
    title="TIES merging",
    tags=("ties",),
    base="required",
    mergekit=Translation(
        names=("ties",),
        translate=translate_ties,
        parameters=(
            Parameter("weight", per_model=True, into="weights"),
            Parameter("density", 1.0, per_model=True, convert=fraction, into="density"),
            Parameter("lambda", 1.0, into="lambda"),
            Parameter("normalize", True, convert=flag, into="normalize", varies=False),
            Parameter("rescale", False, convert=flag, into="rescale", varies=False),
            Parameter("int8_mask", False, convert=flag),
        ),
        base_takes_per_model=False,
    ),
)
