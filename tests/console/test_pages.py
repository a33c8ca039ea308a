"""The console in headless Chromium against the real service: every page shows what the API
answers, progress moves while a merge runs, cancel works from the page, a form shows the API's
error beside its field, and markup stored in a job is shown as text."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from tests.console.browser import PHONE, Page
from tests.console.conftest import PAYLOAD, Seeded
from tests.evaluation.conftest import TASK
from worker.examples import make_checkpoint
from worker.lease import JobLease

PACE_S = 0.05

pytestmark = pytest.mark.browser


def four(value: float) -> str:
    return f"{value:.4f}"


def rows_of(page: Page, css: str) -> list[list[str]]:
    return [
        [cell.text for cell in row.find_elements("css selector", "td")] for row in page.all(css)
    ]


def samples(seeded: Seeded, evaluation_id: str) -> list[dict[str, Any]]:
    response = seeded.client.get(f"/v1/evaluations/{evaluation_id}/samples")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def test_the_console_is_served_with_a_strict_content_security_policy(seeded: Seeded) -> None:
    response = seeded.client.get("/ui/")
    assert response.status_code == 200 and "text/html" in response.headers["content-type"]
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "style-src 'self'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert "<script>" not in response.text and "style=" not in response.text  # nothing inline
    assert seeded.client.get("/ui/js/app.js").headers["content-security-policy"] == policy
    assert seeded.client.get("/ui/nothing-here.js").status_code == 404


def test_the_jobs_page_lists_every_kind_as_the_api_does(page: Page, seeded: Seeded) -> None:
    page.open("/jobs")
    listed = seeded.get("/v1/jobs")["items"]
    rows = page.all("table.jobs tbody tr")
    assert [r.get_attribute("data-job") for r in rows] == [j["id"] for j in listed]
    assert {j["kind"] for j in listed} == {"merge", "evaluation", "analysis", "sweep"}
    for row, job in zip(rows, listed, strict=True):
        assert row.find_element("css selector", ".status").text == job["status"]
    page.screenshot("jobs")

    Select(page.find("select[name=kind]")).select_by_value("sweep")
    page.eventually("the kind filter in the URL", lambda: "kind=sweep" in page.driver.current_url)
    page.settled()
    sweeps = [j["id"] for j in seeded.get("/v1/jobs?kind=sweep")["items"]]
    assert seeded.sweep["id"] in sweeps
    assert [r.get_attribute("data-job") for r in page.all("table.jobs tbody tr")] == sweeps
    page.open("/jobs?q=console")
    named = [j["id"] for j in seeded.get("/v1/jobs?q=console")["items"]]
    assert seeded.merge["id"] in named
    assert [r.get_attribute("data-job") for r in page.all("table.jobs tbody tr")] == named


def test_the_jobs_page_pages_with_the_api_s_cursor(page: Page, seeded: Seeded) -> None:
    first = seeded.get("/v1/jobs?limit=4")
    second = seeded.get(f"/v1/jobs?limit=4&cursor={first['next_cursor']}")
    page.open("/jobs?limit=4")
    shown = [r.get_attribute("data-job") for r in page.all("table.jobs tbody tr")]
    assert shown == [j["id"] for j in first["items"]]
    page.driver.find_element("link text", "Next page").click()
    page.settled()
    page.eventually(
        "the second page",
        lambda: (
            [r.get_attribute("data-job") for r in page.all("table.jobs tbody tr")]
            == [j["id"] for j in second["items"]]
        ),
    )
    page.driver.back()  # the back button returns to the first page
    page.settled()
    page.eventually(
        "the first page again",
        lambda: [r.get_attribute("data-job") for r in page.all("table.jobs tbody tr")] == shown,
    )


def test_the_merge_page_shows_plan_outputs_and_the_comparison(page: Page, seeded: Seeded) -> None:
    merge = seeded.get(f"/v1/merges/{seeded.merge['id']}")  # compared with every input scored
    page.open(f"/merges/{merge['id']}")
    assert page.text("h1") == "Merge console-merge"
    layers = [p for p in merge["plan"] if p["layer"].isdigit()]
    strip = page.all(".strip .layer")
    assert [(s.get_attribute("data-layer"), s.get_attribute("data-origin")) for s in strip] == [
        (p["layer"], p["origin"]) for p in layers
    ]
    files = [[name, sha] for name, _size, sha in rows_of(page, "table.files tbody tr")]
    assert files == [[f["name"], f["sha256"]] for f in merge["output"]["files"]]
    comparison = merge["result"]["evaluation"]["comparison"]
    expected = [
        [four(score["value"]), four(entry["value"]), f"{'+' if entry['difference'] > 0 else ''}"
         f"{four(entry['difference'])}", f"{entry['paired_test']['p_value']:.3f}"]
        for score in comparison for entry in score["inputs"]
    ]  # fmt: skip
    assert expected, "the input expert was evaluated: the merge is compared with it"
    shown = rows_of(page, "table.comparison tbody tr")
    assert [[r[3], r[5], r[6], r[7]] for r in shown] == expected
    page.screenshot("merge")


def test_the_lineage_graph_links_artifacts_and_jobs(page: Page, seeded: Seeded) -> None:
    artifact = seeded.merge["output"]["artifact_id"]
    page.open(f"/artifacts/{artifact}/lineage")
    ancestors = seeded.get(f"/v1/artifacts/{artifact}/lineage")
    nodes = {n.get_attribute("data-node") for n in page.all("svg.graph .node")}
    assert {a["id"] for a in ancestors["artifacts"]} | {seeded.merge["id"]} <= nodes
    labels = {t.text for t in page.all("svg.graph .edge-label")}
    for edge in ancestors["jobs"][0]["inputs"]:
        assert any(label.startswith(edge["role"]) for label in labels), (edge, labels)
    page.screenshot("lineage")
    page.find(f'svg.graph [data-node="{seeded.merge["id"]}"]').click()
    page.eventually(
        "the merge's page", lambda: f"/merges/{seeded.merge['id']}" in page.driver.current_url
    )
    page.settled()
    assert page.text("h1") == "Merge console-merge"


def test_the_evaluation_page_filters_samples_and_shows_the_input_beside(
    page: Page, seeded: Seeded
) -> None:
    evaluation = seeded.evaluation
    page.open(f"/evaluations/{evaluation['id']}")
    scores = rows_of(page, "table.scores tbody tr")
    assert [[r[0], r[1], r[2], r[3]] for r in scores] == [
        [s["task"], s["filter"], s["metric"], four(s["value"])]
        for s in evaluation["result"]["scores"]
    ]
    mine = samples(seeded, evaluation["id"])
    assert len(page.all(".sample")) == len(mine)
    Select(page.find("select[name=show]")).select_by_value("incorrect")
    page.eventually("only the wrong answers", lambda: "show=incorrect" in page.driver.current_url)
    page.settled()
    wrong = [s for s in mine if not s["correct"]]
    shown = page.all(".sample")
    assert len(shown) == len(wrong) and all(
        s.get_attribute("data-correct") == "false" for s in shown
    )

    # Beside the task expert's newest evaluation (the sweep evaluated it again).
    option = next(o for o in page.all("select[name=against] option") if o.text.startswith("task:"))
    expert = option.get_attribute("value")
    evaluated = seeded.get(f"/v1/artifacts/{math_artifact(seeded)}/evaluations")["evaluations"]
    own = [
        seeded.get(f"/v1/evaluations/{e['id']}") for e in evaluated if e["status"] == "succeeded"
    ]
    assert expert == next(e["id"] for e in own if e["result"]["samples"] and e["result"]["ran"])
    theirs = {(s["task"], s["filter"], s["doc_id"]): s for s in samples(seeded, expert)}
    Select(page.find("select[name=against]")).select_by_value(expert)
    page.eventually("the expert beside", lambda: f"against={expert}" in page.driver.current_url)
    page.settled()
    differing = [
        s for s in wrong
        if (other := theirs[(s["task"], s["filter"], s["doc_id"])])["extracted"] != s["extracted"]
        or other["correct"] != s["correct"]
    ]  # fmt: skip
    assert len(page.all(".sample")) == len(differing)
    assert all(
        len(s.find_elements("css selector", ".answers > div")) == 2 for s in page.all(".sample")
    )
    page.screenshot("evaluation")


def math_artifact(seeded: Seeded) -> str:
    """The merge's task expert, as lineage knows it."""
    lineage = seeded.get(f"/v1/artifacts/{seeded.merge['output']['artifact_id']}/lineage")
    (job,) = [j for j in lineage["jobs"] if j["job_id"] == seeded.merge["id"]]
    (task,) = [e["artifact_id"] for e in job["inputs"] if e["role"] == "task"]
    return str(task)


def test_the_sweep_page_ranks_sorts_and_charts(page: Page, seeded: Seeded) -> None:
    sweep = seeded.sweep
    board = seeded.get(f"/v1/sweeps/{sweep['id']}/leaderboard")
    page.open(f"/sweeps/{sweep['id']}")
    table = rows_of(page, "table.leaderboard tbody tr")
    assert [(r[1], r[2]) for r in table] == [
        (row["config"], four(row["mean"])) for row in board["rows"]
    ]
    best = page.find("table.leaderboard tr.best")
    assert (
        best.get_attribute("data-config")
        == board["rows"][0]["config"]
        == sweep["result"]["best"]["config"]
    )
    written = {
        t["artifact_id"]
        for t in sweep["trials"]
        if t["config"] == board["rows"][0]["config"] and t["artifact_id"]
    }
    links = {
        a.get_attribute("href").split("/")[-2]
        for a in page.all("#best ~ ul a[href*='/artifacts/']")
    }
    assert written and links == written

    # The chart: one bar per configuration and language expert, the mean over its pairs.
    for pair in board["per_pair"]:
        language = Path(pair["language_expert"]).name
        for config, cell in pair["configs"].items():
            bar = page.find(f'svg.chart rect.bar[data-config="{config}"][data-series="{language}"]')
            assert float(bar.get_attribute("data-value")) == pytest.approx(cell["value"])
    assert page.find("svg.chart rect.best").get_attribute("data-best") == board["rows"][0]["config"]
    page.screenshot("sweep", at="table.leaderboard")

    page.find('button[data-sort="mean"]').click()  # ascending by mean
    page.eventually("sorted by mean", lambda: "sort=mean" in page.driver.current_url)
    page.settled()
    means = [float(r[2]) for r in rows_of(page, "table.leaderboard tbody tr")]
    assert means == sorted(means)

    Select(page.find("select[name=pair]")).select_by_value("1")
    page.eventually("pair 1", lambda: "pair=1" in page.driver.current_url)
    page.settled()
    pair = board["per_pair"][1]
    assert sorted(rows_of(page, "table.pair tbody tr")) == sorted(
        [config, four(cell["value"]), four(cell["minus_best_expert"])]
        for config, cell in pair["configs"].items()
    )


def test_the_analysis_heatmap_answers_hover_with_layer_module_and_value(
    page: Page, seeded: Seeded
) -> None:
    analysis = seeded.analysis
    data = seeded.get(f"/v1/analyses/{analysis['id']}/analysis.json")
    page.open(f"/analyses/{analysis['id']}")
    suggestion = analysis["result"]["suggestion"]
    assert (
        page.text("#suggestion")
        == f"bottom b = {suggestion['bottom']}, top u = {suggestion['top']}"
    )
    for label, expert in data["experts"].items():
        cells = page.all(f'[data-expert="{label}"] rect[data-row]')
        assert len(cells) == data["layers"] * len(data["kinds"])
        assert [float(c.get_attribute("data-value")) for c in cells] == pytest.approx(
            [v for row in expert["fraction"] for v in row]
        )
    cell = page.find(
        f'[data-expert="math"] rect[data-row="layer 2"][data-column="{data["kinds"][0]}"]'
    )
    ActionChains(page.driver).move_to_element(cell).perform()
    tip = page.eventually("the tooltip", lambda: page.find(".tooltip:not([hidden])"))
    value = data["experts"]["math"]["fraction"][2][0]
    assert tip.text == f"math · layer 2 · {data['kinds'][0]}: {value:.6f}"
    page.screenshot("analysis", at="[data-expert]")


def test_a_bad_value_shows_the_api_s_error_beside_its_field(page: Page, seeded: Seeded) -> None:
    body = {"method": "layer_swap", "experts": {"task": ["math"], "language": ["swh"]},
            "params": {"bottom": 9}}  # fmt: skip
    api = seeded.client.post("/v1/merges", json=body)
    assert api.status_code == 422
    page.open("/new/merge?method=layer_swap")
    page.find("[name='experts.task']").send_keys("math")
    page.find("[name='experts.language']").send_keys("swh")
    page.find("[name='params.bottom']").send_keys("9")
    before = seeded.get("/v1/jobs?kind=merge")["items"]
    page.find("form.create button[type=submit]").click()
    error = page.eventually(
        "the error", lambda: page.find("[data-error-for='params.bottom']:not([hidden])")
    )
    assert error.text == api.json()["error"]["message"]
    assert page.find("[name='params.bottom']").get_attribute("aria-invalid") == "true"
    assert seeded.get("/v1/jobs?kind=merge")["items"] == before, "nothing was queued"
    page.screenshot("new-merge")

    page.find("[name='experts.task']").clear()
    page.find("[name='experts.task']").send_keys("nowhere")
    page.find("[name='params.bottom']").clear()
    page.find("form.create button[type=submit]").click()
    missing = page.eventually(
        "the source's error", lambda: page.find("[data-error-for='experts.task']:not([hidden])")
    )
    assert "nowhere" in missing.text and page.find("[data-error-for='params.bottom']").text == ""


def test_a_sweep_from_a_preset_with_a_bad_budget_shows_the_error_beside_it(
    page: Page, seeded: Seeded
) -> None:
    body = {"preset": "paper-default", "task_experts": ["math"], "language_experts": ["swh"],
            "evaluation": {"tasks": [TASK]}, "objective": {"task": TASK}, "budget": 0}  # fmt: skip
    api = seeded.client.post("/v1/sweeps", json=body)
    assert api.status_code == 422, api.text
    (problem,) = api.json()["error"]["details"]["problems"]
    page.open("/new/sweep")
    assert page.find("[name=preset]").get_attribute("value") == "paper-default"
    typed = {"task_experts": "math", "language_experts": "swh", "evaluation.tasks": TASK,
             "objective.task": TASK, "budget": "0"}  # fmt: skip
    for name, value in typed.items():
        page.find(f"[name='{name}']").send_keys(value)
    page.find("form.create button[type=submit]").click()
    error = page.eventually("the error", lambda: page.find("[data-error-for=budget]:not([hidden])"))
    assert problem["field"] == "budget" and error.text == problem["message"]


def test_markup_stored_in_a_job_is_shown_as_text(page: Page, seeded: Seeded) -> None:
    message = seeded.failed["error"]["message"]
    assert PAYLOAD.split("<script>")[0] in message
    for route in ("/jobs", f"/merges/{seeded.failed['id']}"):
        page.open(route)
        assert message in page.text()
        assert not page.all("main img") and not page.all("main script")
        assert page.driver.execute_script("return window.pwned") is None
    page.screenshot("failed-merge")


def test_progress_moves_while_a_merge_runs_and_cancel_works_from_the_page(
    page: Page, seeded: Seeded, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real merge, paced (each cancel check, made by the merge between chunks, waits a
    # little) so that a browser has time to watch it: unpaced, this one ends within a second.
    check = JobLease.should_cancel

    def paced(lease: JobLease) -> bool:
        time.sleep(PACE_S)
        return check(lease)

    monkeypatch.setattr(JobLease, "should_cancel", paced)
    checkpoints = seeded.live.settings.source_roots[0]
    make_checkpoint(checkpoints / "big-base", layers=8, hidden=512, intermediate=1536, seed=0)
    make_checkpoint(checkpoints / "big-expert", base=checkpoints / "big-base", seed=1)
    body = {"method": "ties", "base": "big-base", "models": ["big-expert"] * 6,
            "output": {"name": "slow"}}  # fmt: skip
    response = seeded.client.post("/v1/merges", json=body)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    page.open(f"/merges/{job_id}")
    seen: set[float] = set()

    def moved() -> bool:
        fraction = float(page.find(".progress").get_attribute("data-fraction"))
        if 0 < fraction < 1:
            seen.add(fraction)
        return len(seen) >= 2

    page.eventually(
        lambda: (
            f"two fractions of {job_id}'s progress between 0 and 1 (saw {seen}; "
            f"the job: {seeded.get(f'/v1/merges/{job_id}')})"
        ),
        moved,
        120,
    )
    page.open("/jobs")
    row = f'tr[data-job="{job_id}"]'
    page.eventually(
        "the row's progress to move",
        lambda: float(page.find(f"{row} .progress").get_attribute("data-fraction")) > max(seen),
    )
    page.screenshot("jobs-running")
    page.click(f"{row} button.danger")
    page.eventually(
        "the row to show canceled", lambda: page.find(f"{row} .status").text == "canceled", 120
    )
    assert seeded.get(f"/v1/merges/{job_id}")["status"] == "canceled"


def test_pages_fit_a_phone_and_are_keyboard_reachable(page: Page, seeded: Seeded) -> None:
    page.driver.set_window_size(*PHONE)
    try:
        for route in ("/jobs", f"/merges/{seeded.merge['id']}", f"/sweeps/{seeded.sweep['id']}"):
            page.open(route)
            assert page.driver.execute_script(
                "return document.documentElement.scrollWidth <= window.innerWidth"
            ), f"{route} scrolls sideways at {PHONE[0]} px"
    finally:
        page.driver.set_window_size(1280, 900)
    page.open("/jobs")
    for _ in range(20):  # the first job's link within a few tabs
        ActionChains(page.driver).send_keys(Keys.TAB).perform()
        focused = page.driver.switch_to.active_element
        if focused.get_attribute("href") and "/merges/" in focused.get_attribute("href"):
            break
    else:
        pytest.fail("no job link reached with the keyboard")
    ActionChains(page.driver).send_keys(Keys.ENTER).perform()
    page.eventually("the merge page", lambda: "/merges/" in page.driver.current_url)


def test_no_request_reads_a_whole_list(seeded: Seeded) -> None:
    """The listing the jobs page reads is bounded, whatever is asked."""
    too_many = seeded.client.get("/v1/jobs?limit=100000")
    assert too_many.status_code == 422
    assert len(seeded.get("/v1/jobs")["items"]) <= 50
