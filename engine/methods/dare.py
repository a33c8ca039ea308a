"""DARE (Yu et al. 2024, "Language Models are Super Mario"), as mergekit's `dare_ties` and
`dare_linear`: each delta keeps every entry with probability `density`, independently, and
by default what is kept is scaled back to the delta's L1 norm (≈ 1/density).

The drops are random but reproducible: entry j of tensor `name`'s delta of models[i] is kept
when the Philox counter-based generator, keyed by (seed, name, i), gives a number below
density at counter j (engine/kernels/random_bits.py). So any chunk of a tensor is made on its own,
and the same recipe gives the same bytes whatever the chunk size, device or thread count.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.methods.sparsify import (
    MAX_SEED,
    SparsifyParams,
    SparsifyRecipe,
    sparsify_method,
    sparsifying_translation,
)

SEED_HELP = "of the random drops: the same seed gives the same bytes"


class DareParams(SparsifyParams):
    seed: int = Field(0, ge=0, le=MAX_SEED, description=SEED_HELP)
    rescale: bool = Field(True, description="scale each thinned delta back to its original L1 norm")

    def random_seed(self) -> int | None:
        return self.seed


class DareTiesRecipe(SparsifyRecipe):
    """mergekit's `dare_ties`: random drops, then TIES's sign consensus."""

    method: Literal["dare_ties"]
    params: DareParams = DareParams()


class DareLinearRecipe(SparsifyRecipe):
    """mergekit's `dare_linear`: random drops, then a weighted sum of the deltas."""

    method: Literal["dare_linear"]
    params: DareParams = DareParams()


DARE_TIES = sparsify_method(
    name="dare_ties",
    recipe=DareTiesRecipe,
    params=DareParams,
    dropping="random",
    consensus=True,
    summary="drop delta entries at random, rescale, elect sign, merge (Yu et al. 2024)",
    formula="base + λ·TIES-merge of wᵢ·DARE(δᵢ), δᵢ = Tᵢ − base",
    title="DARE with TIES sign consensus",
    tags=("dare", "ties"),
    mergekit=sparsifying_translation("dare_ties", normalize=False, rescale=True, random=True),
)
DARE_LINEAR = sparsify_method(
    name="dare_linear",
    recipe=DareLinearRecipe,
    params=DareParams,
    dropping="random",
    consensus=False,
    summary="drop delta entries at random, rescale, add the weighted deltas (Yu et al. 2024)",
    formula="base + λ·Σ wᵢ·DARE(δᵢ) (÷ Σ wᵢ with normalize), δᵢ = Tᵢ − base",
    title="DARE (linear)",
    tags=("dare",),
    mergekit=sparsifying_translation("dare_linear", normalize=False, rescale=True, random=True),
)
