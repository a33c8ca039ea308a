"""The curl (and remote CLI) examples of README.md and docs/ run as written, against a fresh
`layerswap serve` (one per page) set up as `scripts/run.sh` sets it up, and every job they make
succeeds.

Each page's ```bash blocks that talk to the service (a command names http://127.0.0.1:8000) run in
order as one script, so a later block uses the variables an earlier one set. Only the port
differs: the server listens on a free one, substituted for 8000 (and given to the remote CLI as
LAYERSWAP_URL). `curl` is run with --fail-with-body, so an error answer fails the script, not
only a request that cannot connect. A block preceded by `<!-- not run by the tests: why -->`
(e.g. one that needs a Hub token) is left out."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.distributed.conftest import free_port
from tests.docs.reference_hook import ROOT
from tests.helpers import healthy, stop, wait_for

SERVICE = "http://127.0.0.1:8000"
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```bash\n(?P<body>.*?)\n```", re.DOTALL)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LAYERSWAP = Path(sys.executable).parent / "layerswap"
PRELUDE = 'set -euo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n'
SUBMITS = re.compile(r"-X POST \S+/v1/(merges|evaluations|analyses|sweeps)\b|layerswap submit")


def service_blocks(page: Path) -> list[str]:
    return [
        match["body"]
        for match in BLOCK.finditer("\n" + page.read_text())
        if _calls_the_service(match["body"]) and "not run by the tests" not in match["before"]
    ]


def _calls_the_service(block: str) -> bool:
    """The service's address in a command, not only in a comment (`./scripts/run.sh  # ...`)."""
    return any(SERVICE in line.split(" #")[0] for line in block.splitlines())


RUNNABLE = [page for page in PAGES if service_blocks(page)]


@dataclass
class Server:
    url: str
    port: int
    env: dict[str, str]


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `layerswap examples` writes (checkpoints, recipes, evaluation rows), made once."""
    examples = tmp_path_factory.mktemp("docs-examples") / "examples"
    subprocess.run([str(LAYERSWAP), "examples", str(examples)], check=True, timeout=300)
    return examples


@pytest.fixture
def server(examples: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A fresh `layerswap serve` per page, as a reader who just ran scripts/run.sh has: the
    embedded default, the example checkpoints and evaluation rows, loopback webhook receivers
    allowed. (A page's examples do not depend on another page's having run first.)"""
    root = tmp_path_factory.mktemp("docs-service")
    data = root / "data"
    shutil.copytree(examples, data / "checkpoints" / "examples")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env.update(
        LAYERSWAP_DATA_DIR=str(data),
        LAYERSWAP_PORT=str(port),
        LAYERSWAP_EVAL_DATA_DIR=str(data / "checkpoints" / "examples" / "eval-data"),
        LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS='["127.0.0.0/8"]',
    )
    log = root / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(LAYERSWAP), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert process.poll() is None, log.read_text()
            return healthy(url)

        wait_for(up, "the service to start", 120, interval=0.1)
        yield Server(url, port, env)
    finally:
        stop(process, signal.SIGTERM)


def job_statuses(url: str) -> dict[str, str]:
    """Every merge, evaluation and sweep the service holds (the default tenant's), by id."""
    statuses = {}
    for collection in ("merges", "evaluations", "sweeps"):  # analyses have no list
        cursor = None
        while True:
            params = {"limit": 100, **({"cursor": cursor} if cursor else {})}
            page = httpx.get(f"{url}/v1/{collection}", params=params, timeout=30).json()
            statuses.update({item["id"]: item["status"] for item in page["items"]})
            cursor = page.get("next_cursor")
            if not cursor:
                break
    return statuses


def test_pages_with_service_examples_are_found() -> None:
    names = {str(page.relative_to(ROOT)) for page in RUNNABLE}
    assert {"README.md", "docs/getting-started.md", "docs/cli.md"} <= names
    hub = (ROOT / "docs" / "api" / "hub.md").read_text()
    assert SERVICE in hub and not service_blocks(ROOT / "docs" / "api" / "hub.md")


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda page: str(page.relative_to(ROOT)))
def test_examples_run_as_written(page: Path, server: Server, tmp_path: Path) -> None:
    script = "\n".join(service_blocks(page)).replace(SERVICE, server.url)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the remote CLI's `.venv/bin/layerswap`
    before = job_statuses(server.url)
    result = subprocess.run(
        [
            "bash",
            "-c",
            'set -euo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n' + script,
        ],
        cwd=tmp_path,
        env={**server.env, "LAYERSWAP_URL": server.url},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    for written in re.findall(r"-o (\S+)", script):  # e.g. heatmap.png, leaderboard.png
        assert (tmp_path / written).read_bytes().startswith(b"\x89PNG"), written
    made = {id_: status for id_, status in job_statuses(server.url).items() if id_ not in before}
    if SUBMITS.search(script):
        assert made, "the examples made no job"
    assert all(status == "succeeded" for status in made.values()), made
