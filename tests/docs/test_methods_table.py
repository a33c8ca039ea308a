"""The methods' table (docs/hooks/tables.py) carries every registered method, its params with
their defaults and bounds, and its formula; the pages that name the methods by hand name every
one of them."""

from __future__ import annotations

import html
import json
import re
import subprocess
from types import ModuleType, SimpleNamespace

import pytest
from mkdocs.exceptions import PluginError

from engine.methods import METHODS, mergekit_methods
from tests.docs.reference_hook import ROOT, load


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    return load("tables")


def rows(table: str) -> dict[str, str]:
    """Method -> its row, for every "| `method` | ..." row."""
    found = {}
    for line in table.splitlines():
        match = re.match(r"^\| `(\w+)` \|", line)
        if match:
            found[match.group(1)] = line
    return found


def test_the_table_has_a_row_per_method_with_its_params_and_formula(hook: ModuleType) -> None:
    table = rows(hook.methods_table())
    assert list(table) == list(METHODS)
    for name, method in METHODS.items():
        row = table[name]
        assert hook._text(method.formula) in row, name
        assert f"`base` {method.base}" in row, name
        for param in method.parameters():
            if param.required:
                assert f"`{param.name}` (" in row, (name, param.name)
            else:
                assert f"`{param.name}: {json.dumps(param.default)}`" in row, (name, param.name)
            assert html.escape(param.type).replace("|", "&#124;") in row or param.type in (
                "setting",
                "switch",
            )
            if param.bounds is not None:
                assert str(param.bounds) in row, (name, param.name)


def test_the_table_shows_what_a_reader_needs(hook: ModuleType) -> None:
    table = rows(hook.methods_table())
    assert (
        "`density: 0.5` (<code>number &#124; list[setting]</code>, one per model, ∈ (0, 1]"
        in (table["ties"])
    )
    assert "`t: 0.5` (a [setting](#per-layer-settings))" in table["slerp"]
    assert "`filter_wise: false` (a [switch](#per-layer-settings))" in table["model_stock"]
    assert "one per model" in table["linear"] and "2 to 64 `models`" in table["linear"]
    assert "2 `models` (with `slices`, 2 per slice); `base` unused" in table["slerp"]
    assert "`experts`: task and language" in table["layer_swap"]
    assert "`slices: null` (<code>list[{sources}] &#124; null</code>)" in table["passthrough"]
    assert "∈ [0, 0.5)" in table["della"] and "∈ [0, 1)" in table["breadcrumbs"]
    assert "⌊densityᵢ·n⌋ largest \\|δᵢ\\|" in table["ties"]  # a | would end the cell


def test_the_page_gets_the_table_at_its_marker_and_only_there(hook: ModuleType) -> None:
    page = (ROOT / "docs" / hook.METHODS_PAGE).read_text()
    assert page.count(hook.MARKER) == 1
    assert not rows(page).keys() & METHODS.keys(), "a hand-written method row on the page"

    def render(uri: str, markdown: str) -> str:
        found = SimpleNamespace(file=SimpleNamespace(src_uri=uri))
        rendered: str = hook.on_page_markdown(markdown, page=found, config=None, files=None)
        return rendered

    rendered = rows(render(hook.METHODS_PAGE, page))
    assert [name for name in rendered if name in METHODS] == list(METHODS)
    assert render("concepts/layer-swap.md", hook.MARKER) == hook.MARKER
    with pytest.raises(PluginError, match="methods table"):
        render(hook.METHODS_PAGE, "# Other methods\n")


def test_the_readme_and_the_home_page_name_every_method() -> None:
    readme = (ROOT / "README.md").read_text()
    home = (ROOT / "docs" / "index.md").read_text().lower()
    for name in METHODS:
        assert re.search(rf"\b{name}\b", readme), f"README.md does not name {name}"
        # the home page by family: "DARE" stands for dare_ties and dare_linear
        family = name.removesuffix("_ties").removesuffix("_linear")
        words = {name, name.replace("_", " "), family.replace("_", " ")}
        assert any(re.search(rf"\b{w}\b", home) for w in words), f"index.md lacks {name}"


def test_the_mergekit_page_lists_every_mergekit_method_translated() -> None:
    page = (ROOT / "docs" / "concepts" / "mergekit.md").read_text()
    section = page.split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {name for line in table for name in re.findall(r"`(\w+)`", line.split("|")[1])}
    assert listed == set(mergekit_methods())


def test_every_method_mergekit_ships_is_translated() -> None:
    """mergekit 0.1.5's own registry, asked in its virtualenv (bench/setup.sh's .venv-bench)."""
    ask = "from mergekit.merge_methods import registry as r; print(*r._METHODS)"
    found = subprocess.run([ROOT / ".venv-bench" / "bin" / "python", "-c", ask],
                           capture_output=True, text=True, check=True)  # fmt: skip
    shipped = set(found.stdout.split())
    assert {"linear", "ties", "ram", "ramplus_tl"} <= shipped
    assert shipped == set(mergekit_methods())
