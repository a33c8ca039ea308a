"""What an answer may show of the server itself.

With authentication off the service listens on loopback for the one person who runs it and owns
its data directory: answers show absolute paths, where that person loads a merged model from.

With authentication on, callers are tenants who reach the service over HTTP only. An absolute
server path gives them nothing they can use and tells anyone holding a key how the server is
laid out (user names, mounts, the data directory); the services the operator configured (MLflow,
OpenLineage, the broker, the database) are not theirs to see either, and their URLs may carry
credentials. So with auth on:

- every server path in an answer, free text included, is shown relative to the source root (the
  first allowed root), which is also how a request names a source: an output shown as
  `../artifacts/<tenant>/gen1` can be given back as a source as it is. A path outside the source
  roots and the data directory is shown by its last name only;
- a configured service's URL quoted in a message is replaced by the service's name, and a
  result's `tracking_uri` is left out.

The database and the service log keep everything as it was written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from core.settings import Settings
from service.schemas import JobView

# Operator configuration that a job's result may record: not shown to tenants.
HIDDEN_KEYS = frozenset({"tracking_uri"})
# Where a path written into a message ends: whitespace, quotes, separators, brackets.
PATH_TAIL = r"""(?:/[^\s'"`,;:()\[\]{}<>]*)?"""


class Exposure:
    """The operator's view: everything as it is."""

    def location(self, value: str) -> str:
        return value

    def text(self, value: str) -> str:
        return value

    def value(self, value: Any, key: str | None = None) -> Any:
        return value

    def job(self, view: JobView) -> JobView:
        return view


class TenantExposure(Exposure):
    """A tenant's view: server paths relative to the source root, operator settings left out."""

    def __init__(self, settings: Settings) -> None:
        self.base = settings.source_roots[0]
        self.inside = [*settings.source_roots, settings.data_dir.resolve()]
        self.places = _places(settings)
        prefixes = "|".join(re.escape(prefix) for prefix, _ in self.places)
        # A prefix must end at a path boundary: `<data>` is not a prefix of `<data>base`.
        self.pattern = re.compile(f"(?:{prefixes}){PATH_TAIL}(?![\\w.-])") if prefixes else None
        self.services = _services(settings)

    def location(self, value: str) -> str:
        """A stored location: Hub (`hf://`) and other non-paths as they are."""
        if not value.startswith("/"):
            return value
        return self._shown(value)

    def text(self, value: str) -> str:
        # A client library's error may quote the URL it called, credentials and all.
        for written, shown in self.services:
            if written in value:
                value = value.replace(written, shown)
        if self.pattern is None:
            return value
        return self.pattern.sub(lambda found: self._shown(found.group(0)), value)

    def value(self, value: Any, key: str | None = None) -> Any:
        """A JSON-like value (a result, error details): locations and paths in text shown as
        above, operator settings left out."""
        if isinstance(value, dict):
            return {k: self.value(v, k) for k, v in value.items() if k not in HIDDEN_KEYS}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, str):
            return self.location(value) if key == "location" else self.text(value)
        return value

    def job(self, view: JobView) -> JobView:
        error = view["error"]
        if error is not None:
            view["error"] = {
                "code": error["code"],
                "message": self.text(error["message"]),
                "details": self.value(error["details"]),
            }
        output = view["output"]
        if output is not None:
            view["output"] = {**output, "location": self.location(output["location"])}
        if view["result"] is not None:
            view["result"] = self.value(view["result"])
        return view

    def _shown(self, written: str) -> str:
        """One absolute path as a tenant sees it."""
        path = Path(written)
        for prefix, place in self.places:
            if written == prefix or written.startswith(prefix + "/"):
                path = place / written[len(prefix) + 1 :]
                break
        if any(path.is_relative_to(root) for root in self.inside):
            return os.path.relpath(path, self.base)
        return path.name


def _places(settings: Settings) -> list[tuple[str, Path]]:
    """(an absolute prefix as the server writes it, the same directory resolved), longest
    prefix first. Both forms: a path in a message may have been resolved or not."""
    written = [*settings.allowed_roots, *settings.source_roots, settings.data_dir,
               settings.artifacts_dir, settings.cache_dir, settings.evaluations_dir,
               settings.evaluation_data_dir]  # fmt: skip
    if settings.eval_tasks_dir is not None:
        written.append(settings.eval_tasks_dir)
    places: dict[str, Path] = {}
    for directory in written:
        place = directory.resolve()
        for form in (directory.absolute(), place):
            if form.parent != form:  # never `/` itself: every absolute path starts with it
                places.setdefault(str(form), place)
    return sorted(places.items(), key=lambda item: len(item[0]), reverse=True)


def _services(settings: Settings) -> list[tuple[str, str]]:
    """(text naming a service the operator configured, what a tenant is shown instead): each
    URL whole, then any `user:password@` of it alone (a message may rebuild the URL)."""
    urls = {
        settings.mlflow_tracking_uri: "<the MLflow server>",
        settings.openlineage_url: "<the OpenLineage server>",
        settings.broker_url: "<the broker>",
        settings.database: "<the database>",
    }
    found = [(url, label) for url, label in urls.items() if url]
    for url, _ in list(found):
        netloc = urlsplit(url).netloc
        if "@" in netloc:
            found.append((netloc.rpartition("@")[0] + "@", ""))
    return found


OPERATOR = Exposure()
_made: dict[int, tuple[Settings, TenantExposure]] = {}


def exposure_for(settings: Settings) -> Exposure:
    """The view answers of a service with these settings give: a tenant's with auth on."""
    if not settings.auth:
        return OPERATOR
    found = _made.get(id(settings))
    if found is None or found[0] is not settings:
        if len(_made) >= 64:  # a process has one Settings; tests make many
            _made.clear()
        found = _made[id(settings)] = (settings, TenantExposure(settings))
    return found[1]
