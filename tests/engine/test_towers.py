"""A multimodal layer swap: the plan applies to the language model's stack only, and the
vision tower and projector are made whole as `params.towers` says, apart from `non_layer`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.merge import MergeOptions, merge
from engine.recipe import parse_recipe
from tests.engine.families import FAMILY_SPECS, TEXT_LAYERS, forward_check, installed, save_family
from tests.helpers import stringify
from tests.reference import assert_equal, combine, load, swap_region

SWAP = {"bottom": 1, "bottom_transition": 1, "top": 1}


@pytest.mark.parametrize("family", ["gemma3", "llava"])
@pytest.mark.parametrize(("towers", "non_layer"), [("task", "language"), ("language", "average")])
def test_towers_follow_their_own_field(
    tmp_path: Path, family: str, towers: str, non_layer: str
) -> None:
    if not installed(family):
        pytest.fail(f"transformers has no {family!r} config class")
    spec = FAMILY_SPECS[family]
    task_dir, language_dir = (save_family(family, tmp_path / n, s) for s, n in
                              ((1, "task"), (2, "language")))  # fmt: skip
    recipe = {
        "method": "layer_swap",
        "experts": {"task": [task_dir], "language": [language_dir]},
        "params": {**SWAP, "towers": towers, "non_layer": non_layer},
    }
    out = tmp_path / "out"
    result = merge(parse_recipe(stringify(recipe)), out, resolve=Path,
                   options=MergeOptions(durable=False))  # fmt: skip

    task, language, got = load(task_dir), load(language_dir), load(out)
    made = {
        "task": lambda name: task[name],
        "language": lambda name: language[name],
        "average": lambda name: combine([0.5, 0.5], [task[name], language[name]]).to(
            task[name].dtype
        ),
    }
    in_tower = 0
    for name in task:
        match = re.match(rf"{re.escape(spec.stack or '')}\.(\d+)\.", name)
        if match:
            origin = swap_region(int(match.group(1)), TEXT_LAYERS, 1, 1, 1, 0)
            origin = "average" if origin == "transition" else origin
        elif name.startswith(spec.other_stacks):
            origin, in_tower = towers, in_tower + 1
        else:
            origin = non_layer
        assert_equal(got[name], made[origin](name), f"{name} ({origin})")
    assert in_tower > 0  # the tower rule was exercised
    towers_differ = [n for n in task if n.startswith(spec.other_stacks)
                     and not task[n].equal(language[n])]  # fmt: skip
    assert towers_differ  # the choices are told apart
    assert result.manifest["recipe"]["params"]["towers"] == towers
    rows = {row["origin"] for row in result.manifest["layers"]}
    assert any(f"tower: {towers}" in origin for origin in rows), rows
    forward_check(family, out)
