"""The merge page as a model page and a task monitor show a job, in headless Chromium against
the real service: the output's model card rendered from its README.md (markup in it shown as
text, only http(s) links made links), its files with their sizes and download links, the job's
event timeline (whole once ended, live while running), "run again" through the create form
filled in with the job's request, and the executor page."""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.support.ui import Select

from tests.console.browser import Page
from tests.console.conftest import PAYLOAD, VANISHING, Seeded, submit, wait_ended
from tests.helpers import wait_for
from tests.service.conftest import gate, layer_swap  # noqa: F401 (gate: a fixture)

pytestmark = pytest.mark.browser

MARKUP_CARD = """---
tags: [merge]
---
# Title <img src=x onerror="window.pwned=3">

Some *emphasis*, **strong** and `code<script>window.pwned=4</script>` with <b>tags</b>.

- [safe](https://example.org/model)
- [evil](javascript:window.pwned=5)
- [data](data:text/html,<script>window.pwned=6</script>)
- <https://huggingface.co/org/name>

| cell | code |
|---|---|
| <iframe src="javascript:window.pwned=7"></iframe> | `a\\|b` |

```html
<script>window.pwned=8</script>
```
"""


def merged(seeded: Seeded, body: dict[str, Any]) -> dict[str, Any]:
    job = submit(seeded.client, "/v1/merges", body)
    done = wait_ended(seeded.client, f"/v1/merges/{job['id']}")
    assert done["status"] == "succeeded", done
    return done


def card_rows(card: str) -> list[list[str]]:
    """The cells of every table row of a Markdown card, as a reader sees them: no backticks,
    a link's text alone."""
    rows = [line for line in card.splitlines() if line.startswith("|") and "---" not in line]
    plain = [re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", row).replace("`", "") for row in rows]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in plain]


def events_shown(page: Page) -> list[str | None]:
    return [row.get_attribute("data-event") for row in page.all("#timeline tbody tr")]


def test_the_model_card_is_rendered_from_the_outputs_readme(page: Page, seeded: Seeded) -> None:
    merge = seeded.merge
    artifact = merge["output"]["artifact_id"]
    card = seeded.client.get(f"/v1/artifacts/{artifact}/files/README.md").text
    page.open(f"/merges/{merge['id']}")
    shown = page.find("#model-card .markdown")
    assert page.text("#model-card .markdown h3") == "console-merge"
    sections = [line.removeprefix("## ") for line in card.splitlines() if line.startswith("## ")]
    assert sections and [e.text for e in page.all("#model-card .markdown h4")] == sections
    rows = [
        [cell.text for cell in row.find_elements("css selector", "th, td")]
        for row in page.all("#model-card .markdown tr")
    ]
    assert rows == card_rows(card)
    assert ["layer", "origin", "made from"] in rows  # the plan's table, among others
    fenced = card.split("```json\n", 1)[1].split("\n```", 1)[0]
    assert page.find("#model-card pre code[data-language=json]").text == fenced
    front = card.split("---\n")[1].rstrip("\n")
    assert page.find("#model-card details pre").get_attribute("textContent") == front
    assert "```" not in shown.text and "|---" not in shown.text and "## " not in shown.text
    page.screenshot("merge-card", at="#model-card")


def test_markup_in_a_model_card_shows_as_text_and_only_http_links_are_links(
    page: Page, seeded: Seeded
) -> None:
    done = merged(seeded, {**layer_swap(), "output": {"name": "card-markup"}})
    (Path(done["output"]["location"]) / "README.md").write_text(MARKUP_CARD)
    page.open(f"/merges/{done['id']}")
    card = page.find("#model-card")
    assert page.text("#model-card .markdown h3") == 'Title <img src=x onerror="window.pwned=3">'
    for tag in ("img", "script", "iframe", "b"):
        assert not card.find_elements("css selector", tag), tag
    assert page.driver.execute_script("return window.pwned") is None
    links = card.find_elements("css selector", "a")
    assert [a.get_attribute("href") for a in links] == [
        "https://example.org/model",
        "https://huggingface.co/org/name",
    ]
    assert [s.text for s in card.find_elements("css selector", ".link-refused")] == ["evil", "data"]
    assert page.text("#model-card em") == "emphasis" and page.text("#model-card strong") == "strong"
    assert page.text("#model-card p code") == "code<script>window.pwned=4</script>"
    assert "<b>tags</b>" in page.text("#model-card p")
    cells = [td.text for td in card.find_elements("css selector", "td")]
    assert cells == ['<iframe src="javascript:window.pwned=7"></iframe>', "a|b"]
    html = page.find("#model-card pre code[data-language=html]").text
    assert html == "<script>window.pwned=8</script>"


def test_the_outputs_files_show_their_sizes_and_download(page: Page, seeded: Seeded) -> None:
    artifact = seeded.merge["output"]["artifact_id"]
    listed = seeded.get(f"/v1/artifacts/{artifact}/files")["files"]
    page.open(f"/merges/{seeded.merge['id']}")
    rows = page.all("#files table.files tbody tr")
    assert [r.get_attribute("data-file") for r in rows] == [f["name"] for f in listed]
    for row, file in zip(rows, listed, strict=True):
        assert row.find_element("css selector", "td.num").get_attribute("data-size") == str(
            file["size"]
        )
        link = row.find_element("css selector", "a")
        assert link.text == file["name"] and link.get_attribute("download") == file["name"]
        downloaded = seeded.client.get(link.get_attribute("href"))
        assert downloaded.status_code == 200, downloaded.text
        assert len(downloaded.content) == file["size"]
        assert hashlib.sha256(downloaded.content).hexdigest() == file["sha256"]
    assert page.text("#files p").startswith(f"{len(listed)} files, ")


def test_an_ended_merges_timeline_shows_its_events_whole(page: Page, seeded: Seeded) -> None:
    for job in (seeded.merge, seeded.failed):
        events = seeded.get(f"/v1/merges/{job['id']}/events")
        page.open(f"/merges/{job['id']}")
        assert page.find("#timeline").get_attribute("data-live") == "false"
        assert events_shown(page) == [e["type"] for e in events]
        assert events_shown(page)[-1] == job["status"]
    last = page.all("#timeline tbody tr")[-1].find_elements("css selector", "td")[-1].text
    assert last == f"{seeded.failed['error']['code']}: {seeded.failed['error']['message']}"
    assert PAYLOAD.split("<script>")[0] in last  # markup in an event: text
    assert not page.all("main img") and page.driver.execute_script("return window.pwned") is None


def test_an_evaluations_and_an_analyses_pages_show_their_timelines(
    page: Page, seeded: Seeded
) -> None:
    for route in (f"/evaluations/{seeded.evaluation['id']}", f"/analyses/{seeded.analysis['id']}"):
        events = seeded.get(f"/v1{route}/events")
        page.open(route)
        assert events_shown(page) == [e["type"] for e in events], route
        assert events_shown(page)[-1] == "succeeded"


def test_a_running_merge_is_shown_live_on_its_timeline_and_the_executor_page(
    page: Page,
    seeded: Seeded,
    gate: threading.Event,  # noqa: F811
) -> None:
    job_id = submit(seeded.client, "/v1/merges", {**layer_swap(), "output": {"name": "watched"}})[
        "id"
    ]
    wait_for(
        lambda: seeded.get(f"/v1/merges/{job_id}")["status"] == "running",
        f"merge {job_id} to run",
        60,
        interval=0.05,
    )
    page.open("/executor")
    worker = page.find("table.workers tbody tr")
    assert worker.text.startswith("layerswap-jobs")
    assert worker.find_element("css selector", "[data-alive]").get_attribute("data-alive") == "true"
    assert [td.text for td in page.all("table.queues tbody td")] == ["local", "0"]
    running = page.eventually(
        "the merge among the running jobs",
        lambda: page.find(f"table.running a[href='#/merges/{job_id}']"),
    )
    row = running.find_element("xpath", "ancestor::tr")
    assert row.find_element("css selector", "[data-alive]").get_attribute("data-alive") == "true"
    page.screenshot("executor")

    page.open(f"/merges/{job_id}")
    assert page.find("#timeline").get_attribute("data-live") == "true"
    before = events_shown(page)
    assert before[:2] == ["queued", "running"] and "succeeded" not in before
    assert not page.all("#rerun"), "no run again before it ends"
    gate.set()
    page.eventually(
        "the timeline to end", lambda: page.find("#timeline").get_attribute("data-live") == "false"
    )
    events = [e["type"] for e in seeded.get(f"/v1/merges/{job_id}/events")]
    assert events_shown(page) == events and events[-1] == "succeeded"
    assert len(events) > len(before), "the rest arrived while the page was open"
    page.eventually("run again, once ended", lambda: page.find("#rerun"))


def without_output_name(request: dict[str, Any]) -> dict[str, Any]:
    return {**request, "output": {k: v for k, v in request["output"].items() if k != "name"}}


def rerun_from(page: Page, job_id: str) -> None:
    page.open(f"/merges/{job_id}")
    page.click("#rerun")
    page.eventually("the form filled in", lambda: page.find("form.create [name=rest]"))
    page.settled()


def submitted(page: Page, seeded: Seeded, before: str) -> dict[str, Any]:
    page.find("form.create button[type=submit]").click()
    moved = page.eventually(
        "the new merge's page",
        lambda: re.search(r"#/merges/(\w+)$", page.driver.current_url or ""),
    )
    assert moved.group(1) != before
    return wait_ended(seeded.client, f"/v1/merges/{moved.group(1)}")


def test_run_again_sends_the_jobs_request_unchanged_or_edited(page: Page, seeded: Seeded) -> None:
    first = merged(seeded, {**layer_swap(top=2), "output": {"name": "to-run-again"}})
    request = first["request"]
    rerun_from(page, first["id"])
    assert Select(page.find("[name=method]")).first_selected_option.text == "layer_swap"
    assert page.find("[name='experts.task']").get_attribute("value") == "math"
    assert page.find("[name='experts.language']").get_attribute("value") == "swh"
    assert page.find("[name='params.top']").get_attribute("value") == "2"
    assert page.find("[name='output.name']").get_attribute("value") == ""
    assert "was to-run-again" in page.text("form.create")
    again = submitted(page, seeded, first["id"])
    assert again["status"] == "succeeded"
    assert again["output"]["name"] != "to-run-again"
    assert without_output_name(again["request"]) == without_output_name(request)

    rerun_from(page, first["id"])
    page.find("[name='params.top']").clear()
    page.find("[name='params.top']").send_keys("1")
    page.find("[name='output.name']").send_keys("run-again-edited")
    edited = submitted(page, seeded, first["id"])
    assert edited["output"]["name"] == "run-again-edited"
    assert edited["request"]["params"] == {**request["params"], "top": 1}
    assert without_output_name({**edited["request"], "params": request["params"]}) == (
        without_output_name(request)
    )


def test_running_a_failed_merge_again_shows_the_apis_error_beside_its_field(
    page: Page, seeded: Seeded
) -> None:
    rerun_from(page, seeded.failed["id"])
    assert page.find("[name='experts.language']").get_attribute("value") == VANISHING
    before = seeded.get("/v1/jobs?kind=merge")["items"]
    page.find("form.create button[type=submit]").click()
    error = page.eventually(
        "the error", lambda: page.find("[data-error-for='experts.language']:not([hidden])")
    )
    assert VANISHING in error.text  # its source is gone; the markup in its name is text
    assert not page.all("main img") and page.driver.execute_script("return window.pwned") is None
    assert seeded.get("/v1/jobs?kind=merge")["items"] == before, "nothing was queued"
