"""Every model family × layer swap, soup and TIES, through the engine's merge entry point.

Per family, three tiny random checkpoints (base, task, language; different seeds) saved by
transformers. Every output tensor is compared with a reference computed here from the inputs
(layer swap: which input a tensor comes from, by its layer in the language model's stack as
tests/engine/families.py knows it; soup: the mean; TIES: tests/reference.py), then the output
is loaded by transformers and run. The outcomes are rendered into docs/concepts/families.md;
the last test fails when the committed table differs (regenerate with
`REGENERATE_FAMILIES=1 pytest tests/engine/test_families.py -k docs`).
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.engine.families import FAMILY_SPECS, TEXT_LAYERS, forward_check, installed, save_family
from tests.helpers import stringify
from tests.reference import assert_equal, assert_within_ulps, combine, load, swap_region, ties

METHODS = ("layer_swap", "soup", "ties")
SWAP = {"bottom": 1, "bottom_transition": 1, "top": 1}  # 4 layers: language, mix, task, language
# What the engine must refuse, with the names its message must give.
REFUSED = {
    ("t5", "layer_swap"): ("encoder.block", "decoder.block"),
    ("bart", "layer_swap"): ("model.encoder.layers", "model.decoder.layers"),
}
DOC = Path(__file__).parents[2] / "docs" / "concepts" / "families.md"
START, END = "<!-- family matrix: start -->", "<!-- family matrix: end -->"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Cell:
    status: str  # pass | refused | unsupported | fail
    detail: str = ""
    layer_stack: dict[str, Any] | None = None  # as the output's manifest records it


@dataclass(frozen=True)
class Checkpoints:
    base: Path
    task: Path
    language: Path


def recipe(method: str, c: Checkpoints) -> dict[str, Any]:
    if method == "layer_swap":
        experts = {"task": [c.task], "language": [c.language]}
        return {"method": method, "experts": experts, "params": SWAP}
    if method == "soup":
        return {"method": method, "models": [c.task, c.language]}
    return {"method": method, "base": c.base, "models": [c.task, c.language]}


def layer_of(stack: str | None, name: str) -> int | None:
    match = re.match(rf"{re.escape(stack)}\.(\d+)\.", name) if stack else None
    return int(match.group(1)) if match else None


def check_swap(family: str, c: Checkpoints, out: Path) -> None:
    spec = FAMILY_SPECS[family]
    task, language, got = load(c.task), load(c.language), load(out)
    assert set(got) == set(task)
    for prefix in spec.other_stacks:  # the multimodal rule is exercised, not vacuous
        assert any(name.startswith(prefix) for name in got), (family, prefix)
    for name, t in task.items():
        layer = layer_of(spec.stack, name)
        origin = "average" if layer is None else swap_region(layer, TEXT_LAYERS, 1, 1, 1, 0)
        if origin in ("average", "transition"):
            expected = combine([0.5, 0.5], [t, language[name]]).to(t.dtype)
        else:
            expected = {"task": t, "language": language[name]}[origin]
        assert_equal(got[name], expected, f"{family} {name} ({origin})")


def check_soup(family: str, c: Checkpoints, out: Path) -> None:
    task, language, got = load(c.task), load(c.language), load(out)
    assert set(got) == set(task)
    for name, t in task.items():
        assert_equal(got[name], combine([0.5, 0.5], [t, language[name]]).to(t.dtype), name)


def check_ties(family: str, c: Checkpoints, out: Path) -> None:
    base, models, got = load(c.base), [load(c.task), load(c.language)], load(out)
    assert set(got) == set(base)
    for name, b in base.items():
        deltas = [m[name] for m in models]
        expected = ties(b, deltas, [1.0, 1.0], density=0.5, lambda_=1.0, normalize=True)
        # float32 sums in another order: 1 ulp, plus float32 slack where they cancel to ~0
        spread = b.float().abs() + sum((d.float() - b.float()).abs() for d in deltas)
        slack = 4 * torch.finfo(torch.float32).eps * spread
        assert_within_ulps(got[name], expected, 1, f"{family} {name}", slack)


CHECKS = {"layer_swap": check_swap, "soup": check_soup, "ties": check_ties}


class Matrix:
    """Each family's three methods, run once per module, on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cells: dict[str, dict[str, Cell]] = {}

    def cell(self, family: str, method: str) -> Cell:
        if family not in self.cells:
            self.cells[family] = self._run_family(family)
        return self.cells[family][method]

    def _run_family(self, family: str) -> dict[str, Cell]:
        if not installed(family):
            return dict.fromkeys(METHODS, Cell(UNSUPPORTED))
        where = self.root / family
        c = Checkpoints(*(save_family(family, where / n, s) for s, n in enumerate(
            ("base", "task", "language"))))  # fmt: skip
        return {method: self._run(family, method, c) for method in METHODS}

    def _run(self, family: str, method: str, c: Checkpoints) -> Cell:
        from engine.errors import EngineError
        from engine.merge import MergeOptions, merge
        from engine.recipe import parse_recipe

        out = self.root / family / f"out-{method}"
        try:
            result = merge(
                parse_recipe(stringify(recipe(method, c))),
                out,
                resolve=Path,
                options=MergeOptions(durable=False),
            )
        except EngineError as e:
            return Cell("refused", e.message)
        try:
            CHECKS[method](family, c, out)
            forward_check(family, out)
        except Exception:  # recorded: the cell's test shows it, the docs table says fail
            return Cell("fail", traceback.format_exc(limit=-3))
        return Cell("pass", layer_stack=result.manifest["layer_stack"])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", list(FAMILY_SPECS))
def test_family_method(matrix: Matrix, family: str, method: str) -> None:
    cell = matrix.cell(family, method)
    if cell.status == UNSUPPORTED:
        pytest.skip(f"transformers {transformers.__version__} has no {family!r} config class")
    if (family, method) in REFUSED:
        assert cell.status == "refused", cell.detail
        assert "\n" not in cell.detail
        for named in REFUSED[family, method]:
            assert named in cell.detail, cell.detail
        return
    assert cell.status == "pass", cell.detail
    stack = cell.layer_stack
    expected = FAMILY_SPECS[family].stack
    if expected is None:  # merged, but no language stack was claimed
        assert stack is not None and stack["rule"] == "none", stack
    else:
        assert stack is not None and stack["rule"] == "family table", stack
        assert (stack["prefix"], stack["count"]) == (expected, TEXT_LAYERS), stack


def render(matrix: Matrix) -> str:
    """The committed table: one row per family, from the outcomes above."""
    lines = [
        f"Established by `tests/engine/test_families.py` with transformers "
        f"{transformers.__version__}.",
        "",
        "| model_type | language-model layers | layer count | layer_swap | soup | ties |",
        "|---|---|---|---|---|---|",
    ]
    for family in FAMILY_SPECS:
        cells = [matrix.cell(family, m) for m in METHODS]
        stack = next((c.layer_stack for c in cells if c.layer_stack), None)
        where, key = "—", "—"
        if stack and stack["rule"] != "none":
            where, key = f"`{stack['prefix']}.<n>`", f"`{stack['count_key']}`"
        shown = [_shown(c) for c in cells]
        lines.append(f"| `{family}` | {where} | {key} | {' | '.join(shown)} |")
    return "\n".join(lines)


def _shown(cell: Cell) -> str:
    if cell.status == UNSUPPORTED:
        return f"not in transformers {transformers.__version__}"
    return {"pass": "merged, checked", "refused": "refused"}.get(cell.status, "**fails**")


def test_the_docs_table_is_what_the_matrix_established(matrix: Matrix) -> None:
    text = DOC.read_text(encoding="utf-8")
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    regenerated = f"{before}{START}\n{render(matrix)}\n{END}{after}"
    if os.environ.get("REGENERATE_FAMILIES") == "1":
        DOC.write_text(regenerated, encoding="utf-8")
        text = regenerated
    assert text == regenerated, (
        f"{DOC} differs from what the tests established; regenerate it with "
        "`REGENERATE_FAMILIES=1 pytest tests/engine/test_families.py -k docs`:\n" + render(matrix)
    )
