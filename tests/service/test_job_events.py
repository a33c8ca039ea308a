"""GET /v1/<kind>/{id}/events for the kinds beside merges: an analysis's event log as JSON
(whole, and after an event) and as Server-Sent Events over real HTTP; each kind's route knows
only its own jobs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import wait_for
from tests.service.conftest import TERMINAL, layer_swap
from tests.service.live import live_service

ANALYSIS = {"base": "base", "experts": [{"label": "math", "path": "math"}]}


def test_an_analysis_s_events_read_as_json_and_as_a_stream(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with (
        live_service(tmp_path, url, examples) as live,
        httpx.Client(base_url=live.url, timeout=60) as client,
    ):
        shutil.copytree(examples / "base", live.settings.source_roots[0] / "base")
        job = client.post("/v1/analyses", json=ANALYSIS).json()

        def ended() -> dict[str, Any] | None:
            found = dict(client.get(f"/v1/analyses/{job['id']}").json())
            return found if found["status"] in TERMINAL else None

        done = wait_for(ended, f"analysis {job['id']} to end", 120, interval=0.05)
        assert done["status"] == "succeeded", done
        events = client.get(f"/v1/analyses/{job['id']}/events").json()
        types = [e["type"] for e in events]
        assert types[:2] == ["queued", "running"] and types[-1] == "succeeded"
        assert events[-1]["data"]["artifact_id"] == done["result"]["artifact_id"]
        later = client.get(f"/v1/analyses/{job['id']}/events?after={events[0]['id']}").json()
        assert later == events[1:]
        headers = {"Accept": "text/event-stream"}
        path = f"/v1/analyses/{job['id']}/events"
        with client.stream("GET", path, headers=headers) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = list(response.iter_lines())  # ends by itself: the analysis has ended
        data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert [d["type"] for d in data] == types

        merge = client.post("/v1/merges", json=layer_swap()).json()
        for kind, other in (("evaluations", job["id"]), ("analyses", merge["id"])):
            response = client.get(f"/v1/{kind}/{other}/events")
            assert response.status_code == 404, response.text
