"""Small test helpers that do not touch the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def stringify(value: Any) -> Any:
    """Paths -> str throughout a recipe (the schema takes strings)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: stringify(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [stringify(v) for v in value]
    return value


def leftovers(out: Path) -> list[str]:
    """Anything the engine may have left beside `out`: the directory or staging/old copies."""
    parent = out.parent
    if not parent.exists():
        return []
    return sorted(
        p.name
        for p in parent.iterdir()
        if p.name == out.name or p.name.startswith((f".{out.name}.staging-", f".{out.name}.old-"))
    )


def write_recipe(path: Path, recipe: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(stringify(recipe), sort_keys=False), encoding="utf-8")
    return path
