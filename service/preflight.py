"""Checks at submit that need only checkpoint headers: layer counts against the recipe's
parameters, architectures, tensor names, shapes and dtypes, and the output's size against its
inputs' (`max_output_ratio`). A request that cannot be planned is a 422 now instead of a job
that fails later. The output's planned size is returned, for the tenant's quota.

Only recipes whose sources are all local are checked here: Hub sources' headers are fetched by
the job, so such a recipe is checked when its job plans (and fails there with the same error).

A check that passed is remembered for the same recipe over the same files (each input
directory's entries by name, size, mtime, ctime and inode, one scandir each), so repeated
submits over the same checkpoints (sweeps, retries, load) do not read and validate every
header again: that was a quarter of a submit's CPU time (py-spy on `layerswap serve`).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from core.hub.refs import is_hub_source, source_parts
from core.settings import Settings
from core.sources import file_guard, resolve_source
from engine.merge import planned_output_bytes
from engine.mergekit import MergekitOrigin
from engine.plan.output_size import check_output_ratio
from engine.planner import make_plan
from engine.recipe import Recipe, named_sources, recipe_to_dict

REMEMBERED = 256  # checks that passed, least recently used forgotten first

Signature = tuple[tuple[str, int, int, int, int], ...]
# (recipe, input files, max_output_ratio) of a check that passed -> the output's planned bytes
_passed: OrderedDict[tuple[str, tuple[tuple[str, Signature], ...], float], int] = OrderedDict()
_lock = threading.Lock()


def check_headers(
    recipe: Recipe,
    settings: Settings,
    tenant: str,
    *,
    resolved: Mapping[str, Path] | None = None,
    mergekit: MergekitOrigin | None = None,
) -> int | None:
    """The output's planned size in bytes (None: a Hub source's headers are not here yet).
    Raises the engine's RecipeError (OutputTooLarge among them), CheckpointError or
    IncompatibleCheckpointsError. `resolved`: sources the caller has resolved already
    (resolve_source), not resolved again. `mergekit`: the config the recipe was translated
    from, whose checks need the plan."""
    parts = [part for n in named_sources(recipe) for part in source_parts(n.source)]
    if any(is_hub_source(part) for part in parts):
        return None
    known = resolved or {}
    paths = {part: known.get(part) or resolve_source(part, settings, tenant) for part in parts}
    try:
        files = tuple((str(path), directory_signature(path)) for path in paths.values())
    except OSError:  # unreadable: the check below says how, and is not remembered
        files = None
    key = (json.dumps(recipe_to_dict(recipe), sort_keys=True), files or (),
           settings.max_output_ratio)  # fmt: skip
    with _lock:
        if files is not None and key in _passed and mergekit is None:
            _passed.move_to_end(key)
            return _passed[key]
    planned = _checked_plan(recipe, paths, settings, tenant, mergekit)
    if files is None:
        return planned
    with _lock:
        _passed[key] = planned
        while len(_passed) > REMEMBERED:
            _passed.popitem(last=False)
    return planned


def _checked_plan(
    recipe: Recipe,
    paths: Mapping[str, Path],
    settings: Settings,
    tenant: str,
    mergekit: MergekitOrigin | None,
) -> int:
    """Plan from headers (each file read as the job will read it: file_guard) and check the
    plan; the output's planned bytes."""
    plan = make_plan(
        recipe, resolve=paths.__getitem__, headers_only=True, guard=file_guard(settings, tenant)
    )
    try:
        if mergekit is not None:
            mergekit.apply(plan)
        check_output_ratio(plan, settings.max_output_ratio)
        return planned_output_bytes(plan)
    finally:
        plan.close()


def directory_signature(path: Path) -> Signature:
    """What changes when a file of the directory is written, replaced, added or removed (files
    through symlinks, such as a Hub cache snapshot's, by their targets)."""
    found = []
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                st = entry.stat()
            except OSError:  # a dangling symlink: part of the signature by name only
                found.append((entry.name, -1, -1, -1, -1))
                continue
            found.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(sorted(found))
