"""Print the third-party requirements of the project (and of its client) as pip reads them, from
the pyproject files alone: the Dockerfile installs them before it copies the source, so a code
change reuses that layer. Our own packages are left out (installed last, without dependencies).

    python deploy/requirements.py            # the service's and the client's dependencies
    python deploy/requirements.py eval       # the `eval` extra's only
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"layerswap", "layerswap-client"}


def _project(path: Path) -> dict[str, list[str] | dict[str, list[str]]]:
    with path.open("rb") as f:
        return dict(tomllib.load(f)["project"])


def requirements(extras: list[str]) -> list[str]:
    service = _project(ROOT / "pyproject.toml")
    if extras:
        optional = service.get("optional-dependencies", {})
        assert isinstance(optional, dict)
        found = [r for extra in extras for r in optional[extra]]
    else:
        client = _project(ROOT / "client" / "pyproject.toml")
        found = [*list(service["dependencies"]), *list(client["dependencies"])]
    return [r for r in found if r.split("[")[0].split(";")[0].strip() not in OURS]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
