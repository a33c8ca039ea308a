"""scripts/check_code.py: function lengths and deferred imports, run as CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_code.py"


def run_check(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, paths)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def function(name: str, body_lines: int, body: str = "") -> str:
    """A function of 1 + body_lines lines (its `def` and its body)."""
    lines = [f"    {line}" for line in body.splitlines()]
    lines += [f"    x{i} = {i}" for i in range(body_lines - len(lines))]
    return "\n".join([f"def {name}() -> None:", *lines]) + "\n\n\n"


def test_a_function_over_50_lines_is_named_with_its_line(tmp_path: Path) -> None:
    source = tmp_path / "long.py"
    source.write_text(function("short", 5) + function("too_long", 50))  # 51 lines
    result = run_check(source)
    assert result.returncode == 1
    assert f"{source}:9: too_long: 51 lines (at most 50)" in result.stdout
    assert "short" not in result.stdout


def test_a_function_of_50_lines_passes(tmp_path: Path) -> None:
    source = tmp_path / "fifty.py"
    source.write_text(function("fifty", 49) + function("short", 3) * 9)
    result = run_check(source)
    assert result.returncode == 0, result.stdout


def test_a_90th_percentile_over_25_lines_fails(tmp_path: Path) -> None:
    source = tmp_path / "many.py"
    source.write_text("".join(function(f"f{i}", 26 if i < 2 else 3) for i in range(10)))
    result = run_check(source)
    assert result.returncode == 1
    assert "90th percentile of function lengths: 27 lines (at most 25)" in result.stdout


def test_an_import_inside_a_function_without_a_comment_is_flagged(tmp_path: Path) -> None:
    source = tmp_path / "bare.py"
    source.write_text(function("bare", 2, "import json\nfrom decimal import Decimal"))
    result = run_check(source)
    assert result.returncode == 1
    assert f"{source}:2: bare: `import json` inside a function without a comment" in result.stdout
    assert f"{source}:3: bare: `from decimal import Decimal`" in result.stdout


def test_a_commented_deferred_import_passes(tmp_path: Path) -> None:
    source = tmp_path / "commented.py"
    above = "# numpy and torch: seconds to import\nimport json\n\nfrom decimal import Decimal"
    source.write_text(
        function("above", 4, above)
        + function("inline", 1, "import json  # torch: seconds to import")
    )
    result = run_check(source)
    assert result.returncode == 0, result.stdout


def test_a_comment_does_not_cover_an_import_after_other_code(tmp_path: Path) -> None:
    source = tmp_path / "later.py"
    source.write_text(function("later", 3, "# torch: heavy\nimport json\nx = 1\nimport decimal"))
    result = run_check(source)
    assert result.returncode == 1
    assert f"{source}:5: later: `import decimal`" in result.stdout
    assert f"{source}:3:" not in result.stdout


def test_the_shipped_packages_pass() -> None:
    result = run_check()
    assert result.returncode == 0, result.stdout
