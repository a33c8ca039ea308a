"""Checks at submit that need only checkpoint headers: layer counts against the recipe's
parameters, architectures, tensor names, shapes and dtypes. A request that cannot be planned is
a 422 now instead of a job that fails later.

Only recipes whose sources are all local are checked here: Hub sources' headers are fetched by
the job, so such a recipe is checked when its job plans (and fails there with the same error).
"""

from __future__ import annotations

from service.settings import Settings
from service.sources import resolve_source
from worker.engine.planner import make_plan
from worker.engine.recipe import Recipe, named_sources
from worker.hub.refs import is_hub_source


def check_headers(recipe: Recipe, settings: Settings, tenant: str) -> None:
    """Raises the engine's RecipeError, CheckpointError or IncompatibleCheckpointsError."""
    if any(is_hub_source(n.source) for n in named_sources(recipe)):
        return
    plan = make_plan(
        recipe,
        resolve=lambda source: resolve_source(source, settings, tenant),
        headers_only=True,
    )
    plan.close()
