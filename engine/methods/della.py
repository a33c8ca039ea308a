"""DELLA (Deep et al. 2024), MagPrune as mergekit's `della` and `della_linear`: each delta
keeps entry j with a probability that grows with its magnitude's rank within its row, from
density − epsilon (the smallest) to density + epsilon (the largest); what is kept is scaled
back to the delta's L1 norm by default.

Exactly, per row of m entries (a 1-D tensor is one row): r = the rank of |δ| from 0 (equal |δ|
in flat order), p = (density − ε) + 2ε·r/(m − 1) in float32 as mergekit computes it; entry
kept when the Philox generator keyed by (seed, name, model) gives a number below p at its
counter (engine/kernels/random_bits.py): reproducible whatever the chunk size, device or threads.
density ± epsilon must lie in (0, 1) wherever density < 1.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from engine.errors import RecipeError
from engine.methods.dare import SEED_HELP
from engine.methods.sparsify import (
    MAX_SEED,
    PER_MODEL_HELP,
    SPREAD_HELP,
    PerModel,
    SparsifyParams,
    SparsifyRecipe,
    per_model,
    sparsify_method,
    sparsifying_translation,
    spread_fits,
)
from engine.plan.model import Thinning
from engine.schema.params import Range

RESCALE_HELP = "scale each thinned delta back to its original L1 norm"
EPSILON = {"epsilon": 0.15}  # mergekit's default


class DellaParams(SparsifyParams):
    AMOUNTS: ClassVar[tuple[str, ...]] = ("density", "epsilon")

    epsilon: Annotated[PerModel, Range(0, 0.5, high_open=True)] = Field(
        0.15,
        description="keep probabilities span density ± epsilon by magnitude rank, in [0, 0.5): "
        + PER_MODEL_HELP,
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description=SEED_HELP)
    normalize: bool = Field(True, description="divide by the sum of the agreeing weights")
    rescale: bool = Field(True, description=RESCALE_HELP)

    def random_seed(self) -> int | None:
        return self.seed

    def check(self, models: int) -> None:
        super().check(models)
        densities = per_model(self.density, "params.density", models)
        epsilons = per_model(self.epsilon, "params.epsilon", models)
        for (density, _), (epsilon, field) in zip(densities, epsilons, strict=True):
            plain = isinstance(density, float | int) and isinstance(epsilon, float | int)
            if plain and not spread_fits(density, epsilon):  # type: ignore[arg-type]
                raise ValueError(f"{field} is {epsilon} with density {density}: {SPREAD_HELP}")

    def check_tensor(self, thinning: Thinning, fields: dict[str, list[str]], name: str) -> None:
        pairs = zip(thinning.densities, thinning.epsilons, fields["epsilon"], strict=True)
        for density, epsilon, field in pairs:
            if not spread_fits(density, epsilon):
                raise RecipeError.for_field(
                    field, f"{epsilon} with density {density} for {name}: {SPREAD_HELP}"
                )


class DellaLinearParams(DellaParams):
    normalize: bool = Field(False, description="divide by the sum of the weights")


class DellaRecipe(SparsifyRecipe):
    """mergekit's `della`: MagPrune, then TIES's sign consensus."""

    method: Literal["della"]
    params: DellaParams = DellaParams()


class DellaLinearRecipe(SparsifyRecipe):
    """mergekit's `della_linear`: MagPrune, then a weighted sum of the deltas."""

    method: Literal["della_linear"]
    params: DellaLinearParams = DellaLinearParams()


DELLA = sparsify_method(
    name="della",
    recipe=DellaRecipe,
    params=DellaParams,
    dropping="magprune",
    consensus=True,
    summary="drop delta entries at random, larger ones less often, rescale, elect sign, merge "
    "(Deep et al. 2024)",
    formula="base + λ·TIES-merge of wᵢ·MagPrune(δᵢ), δᵢ = Tᵢ − base",
    title="DELLA",
    tags=("della",),
    mergekit=sparsifying_translation(
        "della", normalize=True, rescale=True, amounts=EPSILON, random=True
    ),
)
DELLA_LINEAR = sparsify_method(
    name="della_linear",
    recipe=DellaLinearRecipe,
    params=DellaLinearParams,
    dropping="magprune",
    consensus=False,
    summary="drop delta entries at random, larger ones less often, rescale, add the weighted "
    "deltas (Deep et al. 2024)",
    formula="base + λ·Σ wᵢ·MagPrune(δᵢ) (÷ Σ wᵢ with normalize), δᵢ = Tᵢ − base",
    title="DELLA (linear)",
    tags=("della",),
    mergekit=sparsifying_translation(
        "della_linear", normalize=False, rescale=True, amounts=EPSILON, random=True
    ),
)
