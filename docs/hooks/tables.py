"""MkDocs hook: the tables made from the code's own lists, put where a page has their marker at
build time, so they cannot drift from the code:

- concepts/methods.md: the merge methods, from `engine.methods.METHODS` (each method's inputs,
  its params with their defaults and bounds, and its result per tensor);
- concepts/mergekit.md: mergekit-yaml's flags, from `layerswap.cli.mergekit_flags.FLAGS`.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mkdocs.exceptions import PluginError

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

    from engine.methods import Method
    from engine.schema.params import Param

METHODS_PAGE = "concepts/methods.md"
MARKER = "<!-- methods table -->"
FLAGS_PAGE = "concepts/mergekit.md"
FLAGS_MARKER = "<!-- mergekit-yaml flags -->"
SETTINGS = "#per-layer-settings"  # where settings and switches are explained


def methods_table() -> str:
    """The table, one row per registered method, in METHODS' order."""
    from engine.methods import METHODS

    lines = [
        "| method | inputs | params | result per tensor |",
        "|---|---|---|---|",
    ]
    for method in METHODS.values():
        params = "<br>".join(param_cell(p) for p in method.parameters()) or "none"
        lines.append(
            f"| `{method.name}` | {inputs_cell(method)} | {params} | {_text(method.formula)} |"
        )
    return "\n".join(lines)


def inputs_cell(method: Method) -> str:
    """What a recipe of the method names: experts or how many models, and its base."""
    if method.inputs == "experts":
        named = "`experts`: task and language"
    elif method.at_a_time is not None:
        named = f"{method.at_a_time} `models` (with `slices`, {method.at_a_time} per slice)"
    else:
        field = method.recipe.model_fields["models"]
        low = next((c.min_length for c in field.metadata if hasattr(c, "min_length")), 1)
        high = next((c.max_length for c in field.metadata if hasattr(c, "max_length")), None)
        count = str(low) if low == high else f"{low} to {high}" if high else f"{low} or more"
        named = f"{count} `models`"
    return f"{named}; `base` {method.base}"


def param_cell(param: Param) -> str:
    """`name: default` (its type, one per model, its bounds, whether it varies by layer)."""
    head = f"`{param.name}`" if param.required else f"`{param.name}: {_json(param.default)}`"
    kind = "switch" if "switch" in param.type else "setting"
    link = f"[{kind}]({SETTINGS})"  # a number (true/false), a gradient or {filter, value}s
    notes = [f"a {link}" if param.type == kind else _code(param.type)]
    if param.required:
        notes.append("required")
    if param.per_model:
        notes.append("one per model")
    if param.bounds is not None:
        shown = str(param.bounds)
        notes.append(shown if shown[0] in "<>≤≥" else f"∈ {shown}")
    if param.varies_by_layer and param.type != kind:
        notes.append(f"each {kind} by layer or tensor ({link}s)")
    return f"{head} ({', '.join(notes)})"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _code(text: str) -> str:
    """Inline code that may hold `|`: a Markdown table would split a code span on it."""
    return f"<code>{html.escape(text).replace('|', '&#124;')}</code>"


def _text(text: str) -> str:
    """Plain text in a table cell: no cell breaks, no emphasis."""
    for special in ("\\", "|", "*", "_"):
        text = text.replace(special, "\\" + special)
    return text


# -- MkDocs events -------------------------------------------------------------------------------


def flags_table() -> str:
    """mergekit-yaml's flags: honoured, accepted as no-ops, or refused, each with why."""
    from layerswap.cli.mergekit_flags import flags_table as table

    return table()


# page → (its marker, what replaces it)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    METHODS_PAGE: (MARKER, methods_table),
    FLAGS_PAGE: (FLAGS_MARKER, flags_table),
}


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri not in TABLES:
        return markdown
    marker, table = TABLES[page.file.src_uri]
    if marker not in markdown:
        raise PluginError(f"{page.file.src_uri} has no {marker}: where would its table go?")
    return markdown.replace(marker, table())
