"""Local checkpoint sources: only directories under the configured allowed roots.

Paths are resolved (following `..` and symlinks) before the check, so neither can escape.
Inside the artifacts directory a tenant may read only its own outputs.
"""

from __future__ import annotations

import stat
from pathlib import Path

from core.errors import SourceNotAllowed, SourceNotFound
from core.settings import Settings

# Says where sources may lie without naming the server's directories (service/exposure.py).
OUTSIDE = (
    "is outside the allowed source directories: name a directory under the source root "
    "(a relative path is relative to it), or one of your outputs as its `location` shows it"
)


def resolve_local(
    source: str, roots: list[Path], *, field: str = "source", show_roots: bool = True
) -> Path:
    """Absolute real path of `source` (relative ones are under the first root), or 422.
    `show_roots`: the 422 lists the roots' absolute paths (for the operator, never a tenant)."""
    if "://" in source:
        raise SourceNotAllowed(
            f"{field}: {source}: only local checkpoint directories are supported here "
            "(merges also take hf://org/name[@revision])",
            details={"field": field},
        )
    if "\0" in source:  # no path holds one; resolve() would raise ValueError (a 500)
        raise SourceNotAllowed(f"{field}: not a path (NUL byte)", details={"field": field})
    path = Path(source)
    try:
        real = (path if path.is_absolute() else roots[0] / path).resolve()
    except OSError as e:  # a name too long, a symlink loop
        raise SourceNotAllowed(
            f"{field}: not a usable path ({e.strerror})", details={"field": field}
        ) from None
    if not any(real.is_relative_to(root) for root in roots):
        details: dict[str, object] = {"field": field}
        if show_roots:
            details["allowed_roots"] = [str(r) for r in roots]
        raise SourceNotAllowed(f"{field}: {source} {OUTSIDE}", details=details)
    return real


def resolve_source(
    source: str, settings: Settings, tenant: str, *, field: str = "source", must_exist: bool = True
) -> Path:
    """resolve_local under the configured roots, refusing other tenants' artifacts and (at
    submit time) directories that do not exist."""
    # With auth on the caller is a tenant: the server's directories are not theirs to see.
    real = resolve_local(source, settings.source_roots, field=field, show_roots=not settings.auth)
    artifacts = settings.resolved_artifacts_dir
    if real.is_relative_to(artifacts) and not real.is_relative_to(artifacts / tenant):
        raise SourceNotAllowed(f"{field}: {source} {OUTSIDE}", details={"field": field})
    if must_exist and not _is_directory(real, field):
        raise SourceNotFound(
            f"{field}: {source} is not a checkpoint directory", details={"field": field}
        )
    return real


def _is_directory(path: Path, field: str) -> bool:
    """Path.is_dir() lets some errors through (a name too long, permission denied): each is a
    422 naming the field, never a 500."""
    try:
        return stat.S_ISDIR(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise SourceNotAllowed(
            f"{field}: not a usable path ({e.strerror})", details={"field": field}
        ) from None
