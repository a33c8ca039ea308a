"""A sweep spec, expanded: configurations (from a list, a grid or a preset, scaled to the
model's depth), trials (pair × configuration, plus baselines), each trial's merge recipe, and
the number of jobs it all takes. Pure functions: the API checks a spec with them before anything
is stored, and the advancer asks for more configurations with them.

A grid may list millions of combinations: how many there are, how many fit the model and the
jobs they take are counted from the lists (`space_size`, `planned_jobs`) without building one,
so an oversized grid is refused at once; a grid is only built (`space`) once it is within
bounds, and then only its configurations that fit."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.methods.layer_swap import LayerSwapParams
from service.sweeps.spec import MAX_SPACE, Grid, Pair, SweepCreate

PAPER_LAYERS = 32  # the paper's models (Llama 3.1 8B): presets are stated for this depth
PAPER_DEFAULT = (5, 2)  # bottom, top
ABLATION = ((0, 0), (3, 1), (5, 2), (8, 4))
ABLATION_TRANSITIONS = (0, 1)


class SweepError(ValueError):
    """A spec that cannot be expanded; `field` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Trial:
    """One job of the sweep: a merge of `pair` by `config` (its label), or an expert alone."""

    config: str  # label, e.g. "b=5 u=2", "soup", "expert:task"
    pair: int | None  # index into the sweep's pairs; None for an expert (evaluated once)
    recipe: dict[str, Any] | None  # the merge; None for an expert evaluation
    source: str | None = None  # the expert evaluated, for an expert trial
    params: dict[str, Any] | None = None  # the layer-swap parameters, for searches
    in_memory: bool = False  # evaluate `recipe` assembled in memory instead of merging it


def scaled(layers: int, count: int) -> int:
    return round(count * layers / PAPER_LAYERS)


def label(p: LayerSwapParams) -> str:
    parts = [f"b={p.bottom}", f"u={p.top}"]
    if p.bottom_transition or p.top_transition:
        parts.append(f"t={p.bottom_transition}/{p.top_transition}")
    if p.transition_weights != "uniform":
        parts.append(f"tw={p.transition_weights}")
    if p.non_layer != "average":
        parts.append(f"nl={p.non_layer}")
    return " ".join(parts)


def fits(p: LayerSwapParams, layers: int) -> bool:
    return p.bottom + p.bottom_transition + p.top_transition + p.top <= layers


def space(spec: SweepCreate, layers: int) -> list[LayerSwapParams]:
    """Every configuration the spec allows, deduplicated, in a stable order. Preset values are
    scaled to `layers`; ones that do not fit the model are dropped from grids and presets and
    refused in an explicit list. A grid is built whatever its size: `check_space` first."""
    if spec.configurations is not None:
        for i, p in enumerate(spec.configurations):
            if not fits(p, layers):
                raise SweepError(
                    f"configurations.{i}",
                    f"bottom + transitions + top exceeds the {layers} layers of the model",
                )
        found = list(spec.configurations)
    elif spec.grid is not None:
        found = list(_grid(spec.grid, layers))
    elif spec.preset == "paper-default":
        b, u = PAPER_DEFAULT
        found = [LayerSwapParams(bottom=scaled(layers, b), top=scaled(layers, u))]
    else:  # swap-ablation
        found = [
            LayerSwapParams(
                bottom=scaled(layers, b),
                top=scaled(layers, u),
                bottom_transition=t,
                top_transition=t,
            )
            for (b, u), t in itertools.product(ABLATION, ABLATION_TRANSITIONS)
        ]
    unique = list({label(p): p for p in found if fits(p, layers)}.values())
    if not unique:
        raise _nothing_fits(spec, layers)
    return unique


def _nothing_fits(spec: SweepCreate, layers: int) -> SweepError:
    return SweepError("grid" if spec.grid else "preset", f"no configuration fits {layers} layers")


def _grid(grid: Grid, layers: int) -> Iterator[LayerSwapParams]:
    """The grid's configurations that fit, in the order of the lists' product; a prefix that
    does not fit is not extended (layer counts are >= 0)."""
    weights, non_layer = dict.fromkeys(grid.transition_weights), dict.fromkeys(grid.non_layer)
    for b in grid.bottom:
        for u in (u for u in grid.top if b + u <= layers):
            for bt in (bt for bt in grid.bottom_transition if b + u + bt <= layers):
                for ut in (ut for ut in grid.top_transition if b + u + bt + ut <= layers):
                    for tw, nl in itertools.product(weights, non_layer):
                        yield LayerSwapParams(
                            bottom=b, top=u, bottom_transition=bt, top_transition=ut,
                            transition_weights=tw, non_layer=nl,
                        )  # fmt: skip


def combinations(grid: Grid) -> int:
    """How many configurations the grid lists: the product of its lists' lengths."""
    values = (grid.bottom, grid.top, grid.bottom_transition, grid.top_transition)
    named = (set(grid.transition_weights), set(grid.non_layer))
    return math.prod(len(v) for v in values) * math.prod(len(v) for v in named)


def fitting(grid: Grid, layers: int) -> int:
    """How many of the grid's configurations fit `layers`, counted without building them: the
    number of ways to reach each total of layer counts, list by list (totals past `layers`
    dropped, so at most layers + 1 of them), times the non-numeric choices."""
    ways: Counter[int] = Counter({0: 1})
    for values in (grid.bottom, grid.top, grid.bottom_transition, grid.top_transition):
        reached: Counter[int] = Counter()
        for total, count in ways.items():
            for v in values:
                if total + v <= layers:
                    reached[total + v] += count
        ways = reached
    return ways.total() * len(set(grid.transition_weights)) * len(set(grid.non_layer))


def space_size(spec: SweepCreate, layers: int) -> int:
    """len(space(spec, layers)), a grid's counted without building it."""
    if spec.grid is None:  # a list (at most 256) or a preset: small, built
        return len(space(spec, layers))
    size = fitting(spec.grid, layers)
    if size == 0:
        raise _nothing_fits(spec, layers)
    return size


def check_space(spec: SweepCreate, layers: int) -> None:
    """A random or optuna search chooses among at most MAX_SPACE configurations (the optuna
    sampler is rebuilt over all of them on each ask); a grid search is bounded by its budget."""
    if spec.grid is None or spec.search.strategy == "grid":
        return
    size = space_size(spec, layers)
    if size > MAX_SPACE:
        raise SweepError(
            "grid",
            f"{size} configurations of the grid's {combinations(spec.grid)} combinations fit "
            f"the model's {layers} layers, more than the {MAX_SPACE} a {spec.search.strategy} "
            "search may choose among",
        )


def initial_configurations(spec: SweepCreate, layers: int) -> list[LayerSwapParams]:
    """What is merged at once: the whole space (grid), a seeded sample of it (random), or the
    first batch an optuna search asks for (the advancer asks for the rest)."""
    everything = space(spec, layers)
    search = spec.search
    if search.strategy == "grid":
        return everything
    assert search.trials is not None
    if search.strategy == "random":
        return random.Random(search.seed).sample(everything, min(search.trials, len(everything)))
    return []  # optuna: asked by the advancer


def trials(
    spec: SweepCreate, configs: list[LayerSwapParams], *, baselines: bool = True
) -> list[Trial]:
    """Each configuration on each pair; with `baselines`, the baselines on each pair and the
    experts (each evaluated once) too."""
    pairs = spec.expert_pairs()
    found = [
        Trial(
            label(p),
            i,
            layer_swap_recipe(spec, pair, p),
            params=p.model_dump(mode="json"),
            in_memory=spec.evaluates_in_memory,
        )
        for p in configs
        for i, pair in enumerate(pairs)
    ]
    if not baselines:
        return found
    for baseline in spec.baselines:
        if baseline.method == "experts":
            continue
        found += [
            Trial(baseline_label(baseline.method, params), i,
                  baseline_recipe(spec, pair, baseline.method, params))
            for params in baseline.points()
            for i, pair in enumerate(pairs)
        ]  # fmt: skip
    if any(b.method == "experts" for b in spec.baselines):
        experts = dict.fromkeys([*(p.task for p in pairs), *(p.language for p in pairs)])
        found += [Trial(f"expert:{source}", None, None, source=source) for source in experts]
    return found


def layer_swap_recipe(spec: SweepCreate, pair: Pair, params: LayerSwapParams) -> dict[str, Any]:
    recipe: dict[str, Any] = {
        "method": "layer_swap",
        "experts": {"task": [pair.task], "language": [pair.language]},
        "params": params.model_dump(mode="json"),
    }
    return _common(spec, recipe)


def baseline_label(method: str, params: dict[str, Any]) -> str:
    if not params:
        return method
    return method + " " + " ".join(f"{k}={v}" for k, v in sorted(params.items()))


def baseline_recipe(
    spec: SweepCreate, pair: Pair, method: str, params: dict[str, Any]
) -> dict[str, Any]:
    recipe: dict[str, Any] = {
        "method": method,
        "models": [pair.task, pair.language],
        "params": dict(params),
    }
    return _common(spec, recipe)


def _common(spec: SweepCreate, recipe: dict[str, Any]) -> dict[str, Any]:
    if spec.base is not None:
        recipe["base"] = spec.base
    if spec.credential is not None:
        recipe["credential"] = spec.credential
    return recipe


def job_count(found: list[Trial]) -> int:
    """Jobs the trials create: a merge and its evaluation each; one evaluation for a
    configuration evaluated in memory and for an expert."""
    return sum(2 if t.recipe is not None and not t.in_memory else 1 for t in found)


def planned_jobs(spec: SweepCreate, layers: int) -> int:
    """All the jobs the sweep will have created by its end (optuna's later asks included),
    counted without building a configuration: what `job_count` says of every trial."""
    pairs = len(spec.expert_pairs())
    size = space_size(spec, layers)
    tried = size if spec.search.strategy == "grid" else min(spec.search.trials or 0, size)
    count = tried * pairs * (1 if spec.evaluates_in_memory else 2)
    merged = sum(len(b.points()) for b in spec.baselines if b.method != "experts")
    count += merged * pairs * 2  # a merge and its evaluation each
    if any(b.method == "experts" for b in spec.baselines):
        expert_pairs = spec.expert_pairs()
        count += len({*(p.task for p in expert_pairs), *(p.language for p in expert_pairs)})
    if (spec.evaluates_in_memory and spec.keep == "best") or spec.publish_best is not None:
        count += pairs  # the best configuration, written or published at the end
    return count
