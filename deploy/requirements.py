"""Print the third-party requirements of the project (and of its client) as pip reads them, from
the pyproject files alone: the Dockerfile installs them before it copies the source, so a code
change reuses that layer. Our own packages are left out (installed last, without dependencies);
an extra that names others of ours (`layerswap[worker]`) brings theirs.

    python deploy/requirements.py server               # the base's, the client's and `server`'s
    python deploy/requirements.py --extras-only eval   # the `eval` extra's only
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OURS = {"layerswap", "layerswap-client"}


def _project(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return dict(tomllib.load(f)["project"])


def _name(requirement: str) -> str:
    return re.split(r"[\[;<>=!~ ]", requirement, maxsplit=1)[0].strip()


def _extras(requirement: str) -> list[str]:
    inside = re.search(r"\[([^\]]*)\]", requirement.split(";")[0])
    return [e.strip() for e in inside.group(1).split(",")] if inside else []


def extra_requirements(extras: list[str], optional: dict[str, list[str]]) -> list[str]:
    """The extras' requirements, the extras they name of ours expanded in their place."""
    found: list[str] = []
    for extra in extras:
        for requirement in optional[extra]:
            if _name(requirement) == "layerswap":
                found += extra_requirements(_extras(requirement), optional)
            else:
                found.append(requirement)
    return found


def requirements(extras: list[str], *, extras_only: bool = False) -> list[str]:
    service = _project(ROOT / "pyproject.toml")
    found = extra_requirements(extras, service.get("optional-dependencies", {}))
    if not extras_only:
        client = _project(ROOT / "client" / "pyproject.toml")
        found = [*service["dependencies"], *client["dependencies"], *found]
    unique = list(dict.fromkeys(r for r in found if _name(r) not in OURS))
    return unique


if __name__ == "__main__":
    args = sys.argv[1:]
    only = "--extras-only" in args
    print("\n".join(requirements([a for a in args if a != "--extras-only"], extras_only=only)))
