"""The documentation: the generated configuration and API pages cover the code, the README stays
short and its links resolve, and the pages speak of the product, not of how it was made.

`scripts/test.sh` builds the site with `mkdocs build --strict` (broken links, missing pages and
anchors fail there); these are the checks that build cannot make."""

from __future__ import annotations

import html
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from fastapi.routing import iter_route_contexts

from core.settings import Settings
from tests.docs.reference_hook import ROOT, load


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    return load()


def table_rows(markdown: str) -> dict[str, list[str]]:
    """Variable -> its row's cells, for every `| `LAYERSWAP_...` | ... |` row."""
    rows = {}
    for line in markdown.splitlines():
        match = re.match(r"^\| `(LAYERSWAP_\w+)` \|(.*)\|$", line)
        if match:
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", match.group(2))]
            rows[match.group(1)] = cells
    return rows


def test_configuration_lists_every_setting_once_with_its_default(hook: ModuleType) -> None:
    markdown = hook.configuration_markdown()
    rows = table_rows(markdown)
    expected = {f"LAYERSWAP_{name.upper()}" for name in Settings.model_fields}
    assert set(rows) == expected
    assert len(re.findall(r"^\| `LAYERSWAP_", markdown, flags=re.MULTILINE)) == len(expected)
    for name, field in Settings.model_fields.items():
        kind, default, meaning = rows[f"LAYERSWAP_{name.upper()}"]
        assert kind and default, name
        if field.description:
            shown = html.escape(field.description, quote=False).replace("|", "\\|")
            assert meaning.startswith(shown), name
    assert rows["LAYERSWAP_PORT"][1] == "<code>8000</code>"
    assert rows["LAYERSWAP_EXECUTOR"][0] == "<code>local &#124; celery</code>"
    assert rows["LAYERSWAP_DATABASE_URL"][1] == "none"


def test_every_setting_has_a_description(hook: ModuleType) -> None:
    assert hook.undescribed_settings() == [], "a setting without a description= in Settings"


def test_api_reference_has_every_route_of_the_app(hook: ModuleType, tmp_path: Path) -> None:
    schema = hook.openapi_schema()
    reference = hook.reference_markdown(schema)
    from service.app import create_app

    app = create_app(Settings(data_dir=tmp_path), executor=hook._IdleExecutor())
    routes = [
        (method, context.path)
        for context in iter_route_contexts(app.routes)
        if context.path is not None and getattr(context.route, "include_in_schema", True)
        for method in (context.methods or set()) - {"HEAD"}
    ]
    assert len(routes) > 30
    for method, path in routes:
        documented = re.sub(r":\w+\}", "}", path)  # OpenAPI drops a convertor: {name:path}
        assert f"### `{method} {documented}`" in reference, (method, path)
    for name in schema["components"]["schemas"]:
        assert f"### {name} {{#schema-{name.lower()}}}" in reference, name
    # every model a route names is described on the page
    for target in re.findall(r"\]\(#(schema-[\w-]+)\)", reference):
        assert f"{{#{target}}}" in reference, target


def test_nav_names_only_pages_that_exist_or_are_generated(hook: ModuleType) -> None:
    config: dict[str, Any] = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    generated = {hook.CONFIGURATION_PAGE, hook.REFERENCE_PAGE}

    def pages(entries: list[Any]) -> list[str]:
        found: list[str] = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found += pages(value) if isinstance(value, list) else [value]
        return found

    named = pages(config["nav"])
    assert generated <= set(named)
    for page in named:
        assert page in generated or (ROOT / "docs" / page).is_file(), page
        assert page not in generated or not (ROOT / "docs" / page).exists(), f"{page} is generated"
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk <= set(named), on_disk - set(named)


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"^[a-z]+://", link)]
    assert local, "the README points at the documentation"
    for link in local:
        assert (ROOT / link).exists(), link
    assert "./scripts/run.sh" in readme and "./scripts/test.sh" in readme


def test_every_variable_the_docs_name_is_a_real_setting() -> None:
    fields = {f"LAYERSWAP_{name.upper()}" for name in Settings.model_fields}
    # read by the CLI: its remote commands, and its merges' cache (layerswap/cli/common.py)
    client_side = {"LAYERSWAP_URL", "LAYERSWAP_API_KEY", "LAYERSWAP_CACHE_DIR"}
    scripts = "".join(path.read_text() for path in (ROOT / "scripts").glob("*.sh"))
    script_side = set(re.findall(r"LAYERSWAP_[A-Z0-9_]+", scripts))  # the set-up's own
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for name in set(re.findall(r"LAYERSWAP_[A-Z0-9_]+", page.read_text())):
            assert name in fields | client_side | script_side, (page.name, name)


PROCESS_TALK = [
    r"\bissue \d+",
    r"\b20\d\d-\d\d-\d\d\b",  # dates: a figure is identified by its commit
    r"\blent\b",
    r"\bthis session\b",
    r"\b(second|third|fourth) (round|pass)\b",
    r"\bnot met\b",
    r"\broadmap\b",
]


@pytest.mark.parametrize("pattern", PROCESS_TALK)
def test_docs_speak_of_the_product(pattern: str) -> None:
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        found = re.findall(pattern, page.read_text(), flags=re.IGNORECASE)
        assert not found, (page.relative_to(ROOT), found)
