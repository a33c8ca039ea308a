"""Checks of the code's shape that ruff, mypy and import-linter do not make, over the shipped
packages (engine, core, service, worker, layerswap, the client):

- no function is longer than MAX_LINES, and the 90th percentile of function lengths is at most
  P90_LINES (a function's length: its `def` line to its last, decorators left out);
- an import inside a function says why it is there: a comment on its line, or on the line above
  it (above the run of imports it belongs to), naming the heavy dependency it defers (torch,
  numpy, lm_eval, ...), since everything else belongs at the module's top.

bench/ and tests/ are left out (benchmark and test scenarios read top to bottom as one story),
and so are the database migrations (core/db/migrations: a frozen history, never edited).
Prints each failure as path:line and exits 1 if there is any.

    .venv/bin/python scripts/check_code.py [paths...]
"""

from __future__ import annotations

import ast
import io
import math
import sys
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "core", "service", "worker", "layerswap", "client/layerswap_client")
SKIPPED = {"__pycache__", "migrations"}
MAX_LINES = 50
P90_LINES = 25

Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Report:
    findings: list[Finding]
    lengths: list[int]  # of every function checked

    @property
    def p90(self) -> int:
        """The 90th percentile of the function lengths (nearest rank); 0 without functions."""
        ordered = sorted(self.lengths)
        return ordered[math.ceil(0.9 * len(ordered)) - 1] if ordered else 0


def python_files(paths: Sequence[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_file():
            yield path
        else:
            yield from sorted(p for p in path.rglob("*.py") if not SKIPPED & set(p.parts))


def comment_lines(source: str) -> set[int]:
    """The numbers of the lines that carry a comment."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT}


def deferred_imports(function: Function) -> list[ast.Import | ast.ImportFrom]:
    """The imports in `function`'s own body (a nested function's are its own), in line order."""
    found, stack = [], list[ast.AST](function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def explained(node: ast.stmt, imports: set[int], lines: Sequence[str], comments: set[int]) -> bool:
    """Whether a comment sits on the import, or on the line above the run of imports (blank
    lines between them allowed, as isort groups them) that it belongs to."""
    if comments.intersection(range(node.lineno, (node.end_lineno or node.lineno) + 1)):
        return True
    above = node.lineno - 1
    while above > 0 and (above in imports or not lines[above - 1].strip()):
        above -= 1
    return above in comments


def check_function(
    function: Function, name: str, lines: Sequence[str], comments: set[int]
) -> Iterator[Finding]:
    length = (function.end_lineno or function.lineno) - function.lineno + 1
    if length > MAX_LINES:
        yield Finding(
            name, function.lineno, f"{function.name}: {length} lines (at most {MAX_LINES})"
        )
    deferred = deferred_imports(function)
    imports = {n for d in deferred for n in range(d.lineno, (d.end_lineno or d.lineno) + 1)}
    for node in deferred:
        if not explained(node, imports, lines, comments):
            what = ", ".join(a.name for a in node.names)
            where = f"from {node.module} " if isinstance(node, ast.ImportFrom) else ""
            yield Finding(
                name, node.lineno, f"{function.name}: `{where}import {what}` inside a function "
                "without a comment naming the heavy dependency it defers (else: import it at "
                "the top)",
            )  # fmt: skip


def check_file(path: Path, report: Report) -> None:
    source = path.read_text()
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    lines, comments = source.splitlines(), comment_lines(source)
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            report.lengths.append((node.end_lineno or node.lineno) - node.lineno + 1)
            report.findings.extend(check_function(node, name, lines, comments))


def check(paths: Sequence[Path]) -> Report:
    report = Report(findings=[], lengths=[])
    for path in python_files(paths):
        check_file(path, report)
    if report.p90 > P90_LINES:
        report.findings.append(
            Finding("(all)", 0, f"90th percentile of function lengths: {report.p90} lines "
                    f"(at most {P90_LINES}): split the longest functions")
        )  # fmt: skip
    return report


def main(argv: Sequence[str]) -> int:
    paths = [Path(a).resolve() for a in argv] or [ROOT / p for p in PACKAGES]
    report = check(paths)
    for finding in report.findings:
        print(finding)
    print(
        f"{len(report.lengths)} functions, 90th percentile {report.p90} lines, longest "
        f"{max(report.lengths, default=0)}: {len(report.findings)} problem(s)"
    )
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
