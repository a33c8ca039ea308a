"""Local checkpoint sources: only directories under the configured allowed roots.

Paths are resolved (following `..` and symlinks) before the check, so neither can escape.
"""

from __future__ import annotations

from pathlib import Path

from service.errors import SourceNotAllowed


def resolve_local(source: str, roots: list[Path], *, field: str = "source") -> Path:
    """Absolute real path of `source` (relative ones are under the first root), or 422."""
    if "://" in source:
        raise SourceNotAllowed(
            f"{field}: {source}: only local checkpoint directories are supported",
            details={"field": field},
        )
    path = Path(source)
    real = (path if path.is_absolute() else roots[0] / path).resolve()
    if not any(real.is_relative_to(root) for root in roots):
        raise SourceNotAllowed(
            f"{field}: {source} is outside the allowed source directories",
            details={"field": field, "allowed_roots": [str(r) for r in roots]},
        )
    return real
