"""Local checkpoint sources: only directories under the configured allowed roots.

Paths are resolved (following `..` and symlinks) before the check, so neither can escape.
Inside the artifacts directory a tenant may read only its own outputs. The same holds for the
files of a checkpoint directory: one whose symlink leads elsewhere is refused by name when the
source is resolved, and the engine checks every file it reads again once it is open
(`file_guard`), so a link swapped in after the first check leads nowhere either.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from core.errors import SourceNotAllowed, SourceNotFound
from core.settings import Settings
from engine.io.file_access import FileGuard

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
    source: str,
    settings: Settings,
    tenant: str,
    *,
    field: str = "source",
    must_exist: bool = True,
    check_links: bool = True,
) -> Path:
    """resolve_local under the configured roots, refusing other tenants' artifacts and (at
    submit time) directories that do not exist, or whose symlinks lead where the tenant may not
    read (unless `check_links` is off: the caller only asks whether the directory is there)."""
    # With auth on the caller is a tenant: the server's directories are not theirs to see.
    real = resolve_local(source, settings.source_roots, field=field, show_roots=not settings.auth)
    if _in_others_artifacts(real, settings, tenant):
        raise SourceNotAllowed(f"{field}: {source} {OUTSIDE}", details={"field": field})
    if must_exist and not _is_directory(real, field):
        raise SourceNotFound(
            f"{field}: {source} is not a checkpoint directory", details={"field": field}
        )
    if must_exist and check_links:
        _check_links(real, source, field, settings, tenant)
    return real


def may_read(real: Path, settings: Settings, tenant: str) -> bool:
    """Whether the tenant's sources may read the file at real path `real`: under an allowed
    root, and not in another tenant's artifacts."""
    return any(real.is_relative_to(root) for root in settings.source_roots) and not (
        _in_others_artifacts(real, settings, tenant)
    )


def _in_others_artifacts(real: Path, settings: Settings, tenant: str) -> bool:
    artifacts = settings.resolved_artifacts_dir
    return real.is_relative_to(artifacts) and not real.is_relative_to(artifacts / tenant)


LEADS_OUTSIDE = "is a symbolic link that leads outside the allowed source directories"


def _check_links(directory: Path, source: str, field: str, settings: Settings, tenant: str) -> None:
    """A 422 naming the first entry of the checkpoint directory that is a symlink the tenant
    may not follow (one level: a checkpoint's files lie in its directory)."""
    try:
        with os.scandir(directory) as entries:
            links = sorted(entry.name for entry in entries if entry.is_symlink())
    except OSError as e:
        raise SourceNotAllowed(
            f"{field}: not a usable path ({e.strerror})", details={"field": field}
        ) from None
    for name in links:
        try:
            target = (directory / name).resolve()
        except OSError:  # a symlink loop: it reads nothing
            continue
        if not may_read(target, settings, tenant):
            raise SourceNotAllowed(
                f"{field}: {source}: {name} {LEADS_OUTSIDE}", details={"field": field, "file": name}
            )


def file_guard(settings: Settings, tenant: str) -> FileGuard:
    """The engine's guard for a tenant's job: each file of a local input must be one its
    sources may read (may_read); a Hub input's files, which the job itself linked into the
    Hub cache, must lie in that cache."""
    hub = settings.cache_dir / "hub"
    views, cache = hub / "views", hub.resolve()

    def refused(directory: Path, real: Path) -> str | None:
        if directory.is_relative_to(views):
            return None if real.is_relative_to(cache) else "leads outside the Hub cache"
        return None if may_read(real, settings, tenant) else LEADS_OUTSIDE

    return refused


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
