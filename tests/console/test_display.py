"""How the console draws what the API answers: a stopped job's progress bar, lineage edge
labels that never overlap, the comparison table's numbers and input names, the not-found page,
a chart whose scores are all 0, and one way of writing a date on every page."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tests.console.browser import Page
from tests.console.conftest import Seeded, submit, sweep_body, wait_ended

pytestmark = pytest.mark.browser

# A date as every page writes it: four-digit year, hours and minutes, the time zone's name.
STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}) (\S+)$")
OVERLAPS = """
const boxes = [...document.querySelectorAll(arguments[0])].map((e) => e.getBoundingClientRect());
const found = [];
boxes.forEach((a, i) => boxes.slice(i + 1).forEach((b, k) => {
  if (a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom)
    found.push([i, i + 1 + k]);
}));
return [boxes.length, found];
"""
LINES = """
const range = document.createRange();
range.selectNodeContents(arguments[0]);
return range.getClientRects().length;
"""
COLOUR = "return getComputedStyle(arguments[0]).getPropertyValue(arguments[1])"


def colour(page: Page, css: str, prop: str = "accent-color") -> str:
    return str(page.driver.execute_script(COLOUR, page.find(css), prop))


def test_a_failed_merge_s_progress_is_red_and_says_where_it_stopped(
    page: Page, seeded: Seeded
) -> None:
    failed = seeded.get(f"/v1/merges/{seeded.failed['id']}")
    percent = round(failed["progress"]["fraction"] * 100)
    red = ""
    for route, row in (
        ("/jobs", f'tr[data-job="{failed["id"]}"] '),
        (f"/merges/{failed['id']}", ""),
    ):
        page.open(route)
        shown = page.find(f"{row}.progress")
        assert shown.get_attribute("data-status") == "failed"
        assert shown.text == f"failed at {percent}%"
        red = colour(page, f"{row}.progress progress")
        assert red == colour(page, ".status-failed", "color"), f"{route}: the bar is not red"
    page.open(f"/merges/{seeded.merge['id']}")
    succeeded = colour(page, ".progress progress")
    assert page.text(".progress") == "100%" and succeeded != red
    assert succeeded == colour(page, ".status-succeeded", "color")


def test_lineage_edge_labels_never_overlap_where_one_artifact_feeds_several_jobs(
    page: Page, seeded: Seeded
) -> None:
    merge = seeded.get(f"/v1/merges/{seeded.merge['id']}")
    (task,) = [
        e["artifact_id"]
        for j in seeded.get(f"/v1/artifacts/{merge['output']['artifact_id']}/lineage")["jobs"]
        if j["job_id"] == merge["id"]
        for e in j["inputs"]
        if e["role"] == "task"
    ]
    descendants = seeded.get(f"/v1/artifacts/{task}/lineage?direction=descendants")
    shown = {a["id"] for a in descendants["artifacts"]}
    edges = [e for j in descendants["jobs"] for e in j["inputs"] if e["artifact_id"] in shown]
    from_task = [e for e in edges if e["artifact_id"] == task]
    assert len(from_task) >= 2, "the merge and the sweep's merges all read the task expert"
    page.open(f"/artifacts/{task}/lineage")
    count, overlapping = page.driver.execute_script(OVERLAPS, "svg.graph .edge-label")
    assert count == len(edges)
    assert overlapping == [], f"edge labels drawn over each other: {overlapping}"
    page.screenshot("lineage-fan-out")


def test_the_comparison_keeps_numbers_on_one_line_and_names_each_input(
    page: Page, seeded: Seeded
) -> None:
    merge = seeded.get(f"/v1/merges/{seeded.merge['id']}")
    comparison = merge["result"]["evaluation"]["comparison"]
    inputs = [entry for score in comparison for entry in score["inputs"] or [None]]
    assert any(inputs), "the input expert was evaluated: the merge is compared with it"
    page.open(f"/merges/{merge['id']}")
    assert page.driver.execute_script("return window.innerWidth") == 1280
    rows = page.all("table.comparison tbody tr")
    assert len(rows) == len(inputs)
    numbers = [cell for cell in page.all("table.comparison td.num") if cell.text]
    assert len(numbers) >= 4 * len([entry for entry in inputs if entry])
    for cell in numbers:
        assert page.driver.execute_script(LINES, cell) == 1, f"{cell.text!r} wraps"
    names = [row.find_elements("css selector", "td")[4] for row in rows]
    for cell, entry in zip(names, inputs, strict=True):
        if entry is None:
            continue
        location = seeded.get(f"/v1/artifacts/{entry['artifact_id']}")["location"]
        assert cell.text == f"{entry['role']}: {PurePosixPath(location).name}"
        assert cell.find_element("css selector", "span").get_attribute("title") == location
    assert "task: math" in [cell.text for cell in names]


@pytest.mark.parametrize(
    ("route", "api", "heading"),
    [
        ("/merges/{id}", "/v1/merges/{id}", "Merge not found"),
        ("/artifacts/{id}/lineage", "/v1/artifacts/{id}", "Artifact not found"),
    ],
)
def test_a_missing_job_or_artifact_gets_a_page_that_leads_back(
    page: Page, seeded: Seeded, route: str, api: str, heading: str
) -> None:
    missing = uuid.uuid4().hex
    answer = seeded.client.get(api.format(id=missing))
    assert answer.status_code == 404
    page.open(route.format(id=missing))
    assert page.text("h1") == heading
    assert page.text("main .error") == answer.json()["error"]["message"]
    assert missing in page.text("main .error")
    page.driver.find_element("link text", "Back to the jobs list").click()
    page.settled()
    page.eventually("the jobs list", lambda: page.text("h1") == "Jobs")


def test_a_sweep_whose_scores_are_all_zero_has_a_plain_axis_and_no_empty_best_box(
    page: Page, seeded: Seeded
) -> None:
    # The seeded sweep again, ranked by a filter on which every model here scores 0 (its
    # merges and evaluations are the seeded sweep's, reused).
    body = sweep_body()
    body["objective"] = {**body["objective"], "filter": "flexible-extract"}
    sweep = submit(seeded.client, "/v1/sweeps", body)
    assert wait_ended(seeded.client, f"/v1/sweeps/{sweep['id']}")["status"] == "succeeded"
    board = seeded.get(f"/v1/sweeps/{sweep['id']}/leaderboard")
    assert board["rows"] and {row["mean"] for row in board["rows"]} == {0}, board["rows"]
    page.open(f"/sweeps/{sweep['id']}")
    for chart in page.all("svg.chart"):
        ticks = [t.text for t in chart.find_elements("css selector", "text.tick")]
        assert ticks == ["0.00", "0.25", "0.50", "0.75", "1.00"]
        assert not chart.find_elements("css selector", "rect.best")
    notes = [note.text for note in page.all(".chart-note")]
    assert notes == ["Every score is 0: no configuration stands out."] * 2  # all pairs, one pair
    # The seeded sweep's scores are not all 0: its best configuration is boxed, on round ticks.
    page.open(f"/sweeps/{seeded.sweep['id']}")
    best = page.find("svg.chart rect.best")
    assert float(best.get_attribute("height") or 0) > 0 and not page.all(".chart-note")
    steps = [float(t.text) for t in page.all("svg.chart text.tick")][:5]
    assert steps == pytest.approx([steps[1] * i for i in range(5)]) and steps[1] > 0


def shown_dates(page: Page, css: str) -> list[tuple[str, str]]:
    return [(t.text, t.get_attribute("title") or "") for t in page.all(f"{css} time")]


def local(page: Page, iso: str) -> str:
    zone = ZoneInfo(page.driver.execute_script(
        "return Intl.DateTimeFormat().resolvedOptions().timeZone"
    ))  # fmt: skip
    return datetime.fromisoformat(iso).astimezone(zone).strftime("%Y-%m-%d %H:%M")


def test_every_page_writes_dates_one_way_with_year_time_and_zone(
    page: Page, seeded: Seeded
) -> None:
    merge: dict[str, Any] = seeded.get(f"/v1/merges/{seeded.merge['id']}")
    artifact = seeded.get(f"/v1/artifacts/{merge['output']['artifact_id']}")
    listed = seeded.get("/v1/jobs")["items"]
    pages = [
        ("/jobs", "table.jobs tbody", [j["created_at"] for j in listed]),
        (f"/merges/{merge['id']}", "main .facts", [merge["created_at"], merge["finished_at"]]),
        (f"/artifacts/{artifact['id']}/lineage", "main .facts", [artifact["created_at"]]),
    ]
    zones = set()
    for route, css, expected in pages:
        page.open(route)
        shown = shown_dates(page, css)
        assert [title for _, title in shown] == expected, route
        for text, title in shown:
            found = STAMP.match(text)
            assert found, f"{route}: {text!r}"
            assert found.group(1) == local(page, title)
            zones.add(found.group(2))
    assert len(zones) == 1, zones
