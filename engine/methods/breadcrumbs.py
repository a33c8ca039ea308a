"""Model breadcrumbs (Davari & Belilovsky 2024), as mergekit's `breadcrumbs` and
`breadcrumbs_ties`: each delta drops its largest entries (a `gamma` fraction of the tensor, the
outliers) and its smallest, keeping ⌊density·n⌋ entries in between.

Exactly: with n entries, target = ⌊density·n⌋, top = ⌊gamma·n⌋ and
bottom = max(0, n − target − top), entries are ranked by |δ| from the smallest (equal |δ| in
flat order) and ranks [bottom, bottom + target) are kept. mergekit breaks ties between equal
|δ| by its sort's order, which is not stable; the two agree wherever no two entries at the
edges of the kept range have the same |δ|. No randomness: the result is deterministic.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from engine.methods.sparsify import (
    PER_MODEL_HELP,
    PerModel,
    SparsifyParams,
    SparsifyRecipe,
    sparsify_method,
    sparsifying_translation,
)
from engine.schema.params import Range

GAMMA = {"gamma": 0.01}  # mergekit's default


class BreadcrumbsParams(SparsifyParams):
    AMOUNTS: ClassVar[tuple[str, ...]] = ("density", "gamma")

    gamma: Annotated[PerModel, Range(0, 1, high_open=True)] = Field(
        0.01,
        description=f"fraction of the largest |delta| entries dropped, in [0, 1): {PER_MODEL_HELP}",
    )


class BreadcrumbsRecipe(SparsifyRecipe):
    """mergekit's `breadcrumbs`: outliers and small entries dropped, weighted deltas added."""

    method: Literal["breadcrumbs"]
    params: BreadcrumbsParams = BreadcrumbsParams()


class BreadcrumbsTiesRecipe(SparsifyRecipe):
    """mergekit's `breadcrumbs_ties`: outliers and small entries dropped, sign consensus."""

    method: Literal["breadcrumbs_ties"]
    params: BreadcrumbsParams = BreadcrumbsParams()


BREADCRUMBS = sparsify_method(
    name="breadcrumbs",
    recipe=BreadcrumbsRecipe,
    params=BreadcrumbsParams,
    dropping="outliers",
    consensus=False,
    summary="drop the largest and smallest delta entries, add the weighted deltas "
    "(Davari & Belilovsky 2024)",
    formula="base + λ·Σ wᵢ·crumbs(δᵢ) (÷ Σ wᵢ with normalize), δᵢ = Tᵢ − base",
    title="Model Breadcrumbs",
    tags=("breadcrumbs",),
    mergekit=sparsifying_translation("breadcrumbs", normalize=False, rescale=False, amounts=GAMMA),
)
BREADCRUMBS_TIES = sparsify_method(
    name="breadcrumbs_ties",
    recipe=BreadcrumbsTiesRecipe,
    params=BreadcrumbsParams,
    dropping="outliers",
    consensus=True,
    summary="drop the largest and smallest delta entries, elect sign, merge",
    formula="base + λ·TIES-merge of wᵢ·crumbs(δᵢ), δᵢ = Tᵢ − base",
    title="Model Breadcrumbs with TIES sign consensus",
    tags=("breadcrumbs", "ties"),
    mergekit=sparsifying_translation(
        "breadcrumbs_ties", normalize=False, rescale=False, amounts=GAMMA
    ),
)
