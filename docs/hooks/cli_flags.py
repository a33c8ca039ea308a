"""MkDocs hook: the table of mergekit-yaml's flags on concepts/mergekit.md, generated at build
time from `layerswap.cli.mergekit_flags.FLAGS`, so it cannot drift from the command."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mkdocs.exceptions import PluginError

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

PAGE = "concepts/mergekit.md"
MARKER = "<!-- mergekit-yaml flags -->"


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"{PAGE} has no {MARKER}: where would the flags' table go?")
    from layerswap.cli.mergekit_flags import flags_table

    return markdown.replace(MARKER, flags_table())
