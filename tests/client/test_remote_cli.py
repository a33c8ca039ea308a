"""`layerswap submit | status | wait | lineage` as processes against the real service, and the
client installed on its own (a fresh virtualenv, no torch) talking to it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from service.auth import create_key
from tests.service.conftest import layer_swap
from tests.service.live import Live, live_service

LAYERSWAP = str(Path(sys.executable).parent / "layerswap")
CLIENT = Path(__file__).resolve().parents[2] / "client"


def run(*args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    if key:
        env["LAYERSWAP_API_KEY"] = key
    return subprocess.run([LAYERSWAP, *args], env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip


@pytest.fixture
def live(tmp_path: Path, examples: Path) -> Iterator[Live]:
    with live_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples, auth=True
    ) as running:
        yield running


def test_submit_wait_status_and_lineage_end_to_end(live: Live, tmp_path: Path) -> None:
    from core.db.session import Database

    db = Database(live.settings.database)
    key = create_key(db, "team-a")
    db.dispose()
    recipe = tmp_path / "swap.yaml"
    recipe.write_text(yaml.safe_dump(layer_swap()), encoding="utf-8")

    unauthorized = run("submit", str(recipe), "--server", live.url)
    assert unauthorized.returncode == 2 and "401 unauthorized" in unauthorized.stderr

    submitted = run("submit", str(recipe), "--server", live.url, "--wait", key=key)
    assert submitted.returncode == 0, submitted.stderr
    done = json.loads(submitted.stdout)
    assert done["status"] == "succeeded" and done["artifact_id"]
    assert "merging" in submitted.stderr  # the progress bar, fed by the event stream

    status = run("status", done["id"], "--server", live.url, key=key)
    assert status.returncode == 0 and json.loads(status.stdout)["status"] == "succeeded"
    waited = run("wait", done["id"], "--server", live.url, "-q", key=key)
    assert waited.returncode == 0 and json.loads(waited.stdout)["id"] == done["id"]

    lineage = run("lineage", done["artifact_id"], "--server", live.url, key=key)
    assert lineage.returncode == 0, lineage.stderr
    assert f"job {done['id']} (merge, layer_swap)" in lineage.stdout
    # A tenant's view: sources as a request names them, relative to the source root.
    assert "  in        task  math\n" in lineage.stdout
    assert str(live.settings.data_dir) not in lineage.stdout
    as_json = json.loads(run("lineage", done["artifact_id"], "--server", live.url, "--json",
                             key=key).stdout)  # fmt: skip
    assert as_json["root"] == done["artifact_id"]

    queued = run("submit", str(recipe), "--server", live.url, "--idempotency-key", "k1", key=key)
    again = run("submit", str(recipe), "--server", live.url, "--idempotency-key", "k1", key=key)
    assert queued.returncode == again.returncode == 0
    assert queued.stdout.strip() == again.stdout.strip()  # one job for one key

    recipe.write_text(yaml.safe_dump({**layer_swap(), "params": {"bottom": 9, "top": 9}}))
    refused = run("submit", str(recipe), "--server", live.url, key=key)
    assert refused.returncode == 2 and "422" in refused.stderr
    missing = run("status", "0" * 32, "--server", live.url, key=key)
    assert missing.returncode == 2 and "404 not_found" in missing.stderr
    down = run("status", done["id"], "--server", "http://127.0.0.1:9", key=key)
    assert down.returncode == 2 and "cannot reach" in down.stderr


def test_submit_sends_a_mergekit_config_for_the_service_to_translate(
    live: Live, tmp_path: Path
) -> None:
    from core.db.session import Database

    db = Database(live.settings.database)
    key = create_key(db, "team-a")
    db.dispose()
    config = tmp_path / "mergekit.yml"
    config.write_text(
        "merge_method: linear\n"
        "models:\n"
        "  - {model: math, parameters: {weight: 0.3}}\n"
        "  - {model: swh, parameters: {weight: 0.7}}\n",
        encoding="utf-8",
    )
    submitted = run("submit", str(config), "--server", live.url, "--wait", "-q", key=key)
    assert submitted.returncode == 0, submitted.stderr
    done = json.loads(submitted.stdout)
    assert done["status"] == "succeeded"
    lineage = run("lineage", done["artifact_id"], "--server", live.url, key=key)
    assert f"job {done['id']} (merge, linear)" in lineage.stdout


def test_the_client_installs_and_works_without_torch(live: Live, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    source = tmp_path / "client"  # a copy: pip's build/ stays out of the checkout
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(source)],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert install.returncode == 0, install.stderr
    installed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "layerswap-client" in names and "torch" not in names and "layerswap" not in names

    from core.db.session import Database

    db = Database(live.settings.database)
    key = create_key(db, "team-b")
    db.dispose()
    script = (
        "import sys, layerswap_client as ls\n"
        f"c = ls.Client({live.url!r}, api_key={key!r})\n"
        f"job = c.merges.wait(c.merges.create({layer_swap()!r}).id)\n"
        "print(job.status, job.output.artifact_id)\n"
        "assert 'torch' not in sys.modules\n"
    )
    used = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert used.returncode == 0, used.stderr
    status, artifact = used.stdout.split()
    assert status == "succeeded" and len(artifact) == 32
