"""docs/hooks/*.py, imported by path as MkDocs imports them (docs/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load(name: str = "reference") -> ModuleType:
    """docs/hooks/<name>.py, freshly imported."""
    spec = importlib.util.spec_from_file_location(
        f"layerswap_docs_{name}", ROOT / "docs" / "hooks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
