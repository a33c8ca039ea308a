"""docs/concepts/mergekit.md's "Tested against published configs" section is made from the lists of
tests/engine/test_mergekit_corpus.py (what differs from mergekit and why, what both refuse), so
the page says what the test finds. The test below fails when the committed section differs;
regenerate it with
`REGENERATE_MERGEKIT_CORPUS=1 pytest tests/docs/test_mergekit_corpus_docs.py`.
"""

from __future__ import annotations

import os
import textwrap
from collections import Counter

from tests.docs.reference_hook import ROOT
from tests.engine.corpus_standins import corpus
from tests.engine.test_mergekit_corpus import BOTH_REFUSE, CONFIG_NORMALISED, KNOWN

PAGE = ROOT / "docs" / "concepts" / "mergekit.md"
START = "<!-- published configs: start (tests/docs/test_mergekit_corpus_docs.py) -->"
END = "<!-- published configs: end -->"
REGENERATE = "`REGENERATE_MERGEKIT_CORPUS=1 pytest tests/docs/test_mergekit_corpus_docs.py`"


def render() -> str:
    configs = corpus()
    equal = len(configs) - len(KNOWN) - len(BOTH_REFUSE)
    normalised = "; ".join(f"`{key}` ({why})" for key, why in CONFIG_NORMALISED.items())
    prose = (
        f"`tests/engine/test_mergekit_corpus.py` runs the {len(configs)} published configs of "
        "`tests/engine/mergekit_corpus/` (mergekit's examples, model cards, issues and "
        "tutorials, each kept as published) through `layerswap merge` and mergekit 0.1.5, on "
        "tiny stand-ins of the models each names (their family, layer count and dtype), and "
        "compares every output file: each tensor's name, dtype, shape and bytes, config.json, "
        "generation_config.json, the tokenizer's files and the chat template. Set aside in "
        f"config.json: {normalised}. Today {equal} are equal, {len(KNOWN)} differ for the "
        f"reasons below, and {len(BOTH_REFUSE)} are refused by both, as mergekit refuses them."
    )
    lines = [
        textwrap.fill(prose, width=100, break_on_hyphens=False, break_long_words=False),
        "",
        *_per_method(),
        "",
        "| why a config differs | configs |",
        "|---|---|",
        *_reasons(),
    ]
    refused = ", ".join(f"`{_number(n)}` (`{field}`)" for n, field in sorted(BOTH_REFUSE.items()))
    lines += ["", f"Refused by both, Layerswap naming the field: {refused}."]
    return "\n".join(lines)


def _per_method() -> list[str]:
    rows = [
        "| merge_method | configs | equal | differ | refused by both |",
        "|---|---|---|---|---|",
    ]
    counts: dict[str, Counter[str]] = {}
    for name, published in corpus().items():
        kind = "differ" if name in KNOWN else "both" if name in BOTH_REFUSE else "equal"
        counts.setdefault(published.method, Counter())[kind] += 1
    for method, found in sorted(counts.items()):
        total = sum(found.values())
        rows.append(
            f"| `{method}` | {total} | {found['equal']} | {found['differ']} | {found['both']} |"
        )
    return rows


def _reasons() -> list[str]:
    """One row per reason, with the configs it applies to, most frequent first."""
    by_reason: dict[str, list[str]] = {}
    for name, reasons in sorted(KNOWN.items()):
        for reason in reasons.split("; "):
            by_reason.setdefault(reason, []).append(_number(name))
    ordered = sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[1]))
    return [
        f"| {reason.replace('|', chr(92) + '|')} | {', '.join(f'`{n}`' for n in names)} |"
        for reason, names in ordered
    ]


def _number(name: str) -> str:
    return name.split("-", 1)[0]


def test_the_page_says_what_the_corpus_test_finds() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert page.count(START) == 1 and page.count(END) == 1, f"{PAGE} lacks the markers"
    head, rest = page.split(START)
    section, tail = rest.split(END)
    if os.environ.get("REGENERATE_MERGEKIT_CORPUS") == "1":
        PAGE.write_text(f"{head}{START}\n{render()}\n{END}{tail}", encoding="utf-8")
        return
    assert section.strip() == render(), (
        f"the section is out of date: regenerate it with {REGENERATE}"
    )


def test_the_lists_name_corpus_configs_once_each() -> None:
    names = set(corpus())
    assert set(KNOWN) <= names and set(BOTH_REFUSE) <= names
    assert not set(KNOWN) & set(BOTH_REFUSE)
    for reasons in KNOWN.values():
        assert all(reason.strip() for reason in reasons.split("; ")), reasons
