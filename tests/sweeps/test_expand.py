"""Expanding sweep specs: presets scaled to the model's depth, grids less what does not fit,
seeded random samples, job counts, and the optuna search's asks."""

from __future__ import annotations

import itertools
import math
import random
import tracemalloc
from typing import Any

import pytest

from service.sweeps.advance import suggest
from service.sweeps.expand import (
    SweepError,
    check_space,
    combinations,
    fitting,
    initial_configurations,
    job_count,
    label,
    planned_jobs,
    space,
    space_size,
    trials,
)
from service.sweeps.spec import SweepCreate

EVALUATION = {"tasks": ["mgsm_local_direct_sw"]}
OBJECTIVE = {"task": "mgsm_local_direct_sw"}


def spec(**values: Any) -> SweepCreate:
    body = {"task_experts": ["t1", "t2"], "language_experts": ["l1"], "evaluation": EVALUATION,
            "objective": OBJECTIVE, **values}  # fmt: skip
    return SweepCreate.model_validate(body)


def test_presets_are_the_papers_on_32_layers_and_scale_with_depth() -> None:
    assert [label(p) for p in space(spec(preset="paper-default"), 32)] == ["b=5 u=2"]
    assert [label(p) for p in space(spec(preset="paper-default"), 16)] == ["b=2 u=1"]
    ablation = [label(p) for p in space(spec(preset="swap-ablation"), 32)]
    assert ablation == ["b=0 u=0", "b=0 u=0 t=1/1", "b=3 u=1", "b=3 u=1 t=1/1", "b=5 u=2",
                        "b=5 u=2 t=1/1", "b=8 u=4", "b=8 u=4 t=1/1"]  # fmt: skip
    # On 6 layers (3, 1) and (5, 2) both round to (1, 0): one configuration, not two.
    small = [label(p) for p in space(spec(preset="swap-ablation"), 6)]
    assert small == ["b=0 u=0", "b=0 u=0 t=1/1", "b=1 u=0", "b=1 u=0 t=1/1", "b=2 u=1",
                     "b=2 u=1 t=1/1"]  # fmt: skip


def test_grids_drop_what_does_not_fit_and_lists_refuse_it() -> None:
    grid = spec(grid={"bottom": [0, 3, 5], "top": [0, 2], "bottom_transition": [0, 1]})
    found = space(grid, 6)
    assert all(p.bottom + p.top + p.bottom_transition <= 6 for p in found)
    assert len(found) == 3 * 2 * 2 - 2  # (5, 2, 0) and (5, 2, 1) do not fit
    with pytest.raises(SweepError) as refused:
        space(spec(configurations=[{"bottom": 1, "top": 1}, {"bottom": 5, "top": 2}]), 6)
    assert refused.value.field == "configurations.1"
    with pytest.raises(SweepError):
        space(spec(grid={"bottom": [7], "top": [1]}), 6)


def test_random_samples_are_seeded_and_within_the_space() -> None:
    grid = {"bottom": [0, 1, 2, 3], "top": [0, 1, 2]}
    one = initial_configurations(spec(grid=grid, search={"strategy": "random", "trials": 5}), 32)
    two = initial_configurations(spec(grid=grid, search={"strategy": "random", "trials": 5}), 32)
    assert [label(p) for p in one] == [label(p) for p in two] and len(one) == 5
    other = spec(grid=grid, search={"strategy": "random", "trials": 5, "seed": 9})
    assert [label(p) for p in initial_configurations(other, 32)] != [label(p) for p in one]
    everything = spec(grid=grid, search={"strategy": "random", "trials": 500})
    assert len(initial_configurations(everything, 32)) == 12


def test_trials_and_job_counts() -> None:
    body = spec(configurations=[{"bottom": 1, "top": 1}, {"bottom": 2, "top": 1}],
                baselines=[{"method": "soup"}, {"method": "experts"}])  # fmt: skip
    found = trials(body, initial_configurations(body, 6))
    merges = [t for t in found if t.recipe is not None]
    assert len(merges) == (2 + 1) * 2  # (2 configurations + soup) × 2 pairs
    assert sorted(t.source for t in found if t.recipe is None) == ["l1", "t1", "t2"]
    # In memory (the default): one evaluation per layer-swap trial, a merge and an evaluation
    # per soup, one evaluation per expert, and the best configuration written on both pairs.
    assert [t.in_memory for t in merges] == [True] * 4 + [False] * 2
    assert planned_jobs(body, 6) == 4 + 2 * 2 + 3 + 2
    written = body.model_copy(update={"in_memory": False})
    assert planned_jobs(written, 6) == 2 * len(merges) + 3
    swap = merges[0].recipe
    assert swap == {"method": "layer_swap", "experts": {"task": ["t1"], "language": ["l1"]},
                    "params": merges[0].params}  # fmt: skip
    optuna = spec(grid={"bottom": [0, 1, 2], "top": [1]},
                  search={"strategy": "optuna", "trials": 2})  # fmt: skip
    assert planned_jobs(optuna, 6) == 2 * 2 + 2  # 2 trials × 2 pairs in memory + the best
    kept = optuna.model_copy(update={"keep": "all"})  # written: merge + evaluation each
    assert planned_jobs(kept, 6) == 2 * 2 * 2


def test_optuna_asks_untried_configurations_deterministically() -> None:
    body = spec(grid={"bottom": [0, 1, 2, 3], "top": [0, 1]},
                search={"strategy": "optuna", "trials": 6})  # fmt: skip
    candidates = space(body, 6)
    first = suggest(body, candidates, {}, {}, 2)
    assert len(first) == 2 and len({label(p) for p in first}) == 2
    asked = {label(p): p.model_dump() for p in first}
    told = {label(first[0]): 0.5, label(first[1]): None}  # one scored, one failed
    again = suggest(body, candidates, asked, told, 3)
    assert [label(p) for p in again] == [
        label(p) for p in suggest(body, candidates, asked, told, 3)
    ]
    assert not {label(p) for p in again} & set(asked)
    # Every configuration asked: nothing more.
    everything = {label(p): p.model_dump() for p in candidates}
    assert suggest(body, candidates, everything, {}, 2) == []


# A grid of the most values each list may hold: 6,291,456 combinations in a request of 1 KB.
BOMB = {"bottom": list(range(64)), "top": list(range(64)), "bottom_transition": list(range(16)),
        "top_transition": list(range(16)), "transition_weights": ["uniform", "magnitude"],
        "non_layer": ["average", "task", "language"]}  # fmt: skip


def fitting_by_hand(layers: int) -> int:
    """BOMB's configurations that fit: for each pair of transitions and each bottom, the tops
    that fit the layers left, times the 2 × 3 non-numeric choices."""
    found = 0
    for bt, ut in itertools.product(range(16), range(16)):
        left = layers - bt - ut
        found += sum(min(63, left - b) + 1 for b in range(min(63, left) + 1))
    return found * 6


def test_a_grid_of_millions_is_counted_not_built() -> None:
    tracemalloc.start()
    try:
        bomb = spec(grid=BOMB)
        assert bomb.grid is not None
        assert combinations(bomb.grid) == 64 * 64 * 16 * 16 * 2 * 3 == 6_291_456
        for layers in (6, 32, 126):
            assert fitting(bomb.grid, layers) == fitting_by_hand(layers)
        # 2 pairs evaluated in memory, the best configuration written for each at the end.
        assert planned_jobs(bomb, 6) == fitting_by_hand(6) * 2 + 2
        with pytest.raises(SweepError) as refused:
            check_space(spec(grid=BOMB, search={"strategy": "random", "trials": 5}), 32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak  # bytes: the 6 million configurations were never built
    assert refused.value.field == "grid"
    message = str(refused.value)
    assert f"{fitting_by_hand(32)} configurations of the grid's 6291456 combinations" in message
    assert "more than the 10000 a random search may choose among" in message


def test_a_baseline_space_runs_the_method_at_each_point() -> None:
    body = spec(
        configurations=[{"bottom": 1, "top": 1}],
        baselines=[{"method": "ties", "params": {"lambda": 1.0},
                    "space": {"density": [0.3, 0.7], "normalize": [True, False]}}],
    )  # fmt: skip
    found = trials(body, initial_configurations(body, 6))
    ties = [t for t in found if t.recipe is not None and t.recipe["method"] == "ties"]
    assert len(ties) == 4 * 2  # 2 densities × 2 normalize, on each of 2 pairs
    points = {(t.recipe["params"]["density"], t.recipe["params"]["normalize"]) for t in ties}
    assert points == {(0.3, True), (0.3, False), (0.7, True), (0.7, False)}
    assert all(t.recipe["params"]["lambda"] == 1.0 for t in ties)
    assert len({t.config for t in ties}) == 4  # a leaderboard row per point
    assert "density=0.3" in ties[0].config
    assert planned_jobs(body, 6) == 2 + 4 * 2 * 2 + 2  # swaps in memory, ties written, best
    assert planned_jobs(body, 6) == job_count(found) + 2


@pytest.mark.parametrize(
    ("baseline", "message"),
    [
        ({"method": "ties", "params": {"density": 0.5}, "space": {"density": [0.3]}},
         "space.density: also given in params"),
        ({"method": "ties", "space": {f"p{i}": list(range(16)) for i in range(2)}},
         "space: more than 64 points"),
        ({"method": "experts", "space": {"density": [0.3]}}, "takes no params"),
        ({"method": "ties", "space": {"density": []}}, "at least 1 item"),
        ({"method": "layer_swap"}, "must be experts or one of"),
    ],
)  # fmt: skip
def test_bad_baseline_spaces_are_refused(baseline: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(configurations=[{"bottom": 1, "top": 1}], baselines=[baseline])


def test_counted_sizes_are_what_the_expansion_builds() -> None:
    rng = random.Random(5)
    for case in range(40):
        grid: dict[str, list[Any]] = {name: rng.sample(range(9), rng.randint(1, 4))  # no order
                for name in ("bottom", "top", "bottom_transition", "top_transition")}  # fmt: skip
        grid["transition_weights"] = rng.choice([["uniform"], ["magnitude", "uniform"]] * 2
                                                + [["uniform", "uniform"]])  # fmt: skip
        grid["non_layer"] = rng.choices(["average", "task", "language"], k=rng.randint(1, 3))
        layers = rng.randint(1, 20)
        body = spec(
            grid=grid, baselines=rng.choice([[], [{"method": "soup"}, {"method": "experts"}]]),
            keep=rng.choice(["best", "all", "none"]), in_memory=rng.random() < 0.5,
            search=rng.choice([{}, {"strategy": "random", "trials": rng.randint(1, 30)}]),
        )  # fmt: skip
        by_product = [
            p for p in itertools.product(*grid.values()) if sum(p[:4]) <= layers
        ]  # every listed combination, then those that fit
        assert body.grid is not None
        assert combinations(body.grid) == math.prod(len(set(v)) for v in grid.values())
        if not by_product:
            with pytest.raises(SweepError):
                space_size(body, layers)
            continue
        built = space(body, layers)
        assert space_size(body, layers) == len(built) == len(set(by_product)), case
        assert [tuple(p.model_dump().values())[:6] for p in built] == list(
            dict.fromkeys(by_product)
        )  # the product's order: seeded random samples and optuna's choices stay as they were
        final = len(body.expert_pairs()) if body.evaluates_in_memory and body.keep == "best" else 0
        expanded = job_count(trials(body, initial_configurations(body, layers))) + final
        assert planned_jobs(body, layers) == expanded, case
