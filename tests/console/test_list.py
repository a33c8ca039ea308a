"""The jobs list in headless Chromium against the real service: each job's method and run time,
the count of all the filters match, pages forward and back, sorting by a column's heading in
the API's order both ways, and merges or evaluations ticked and compared side by side (a page
a URL can share), the values that differ marked."""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

import pytest
from selenium.webdriver.support.ui import Select

from tests.console.browser import Page
from tests.console.conftest import Seeded

pytestmark = pytest.mark.browser

ROWS = "table.jobs tbody tr"


def shown(page: Page) -> list[str | None]:
    return [row.get_attribute("data-job") for row in page.all(ROWS)]


def ids(listing: dict[str, Any]) -> list[str]:
    return [job["id"] for job in listing["items"]]


def seconds(text: str) -> float:
    """The console's run time (`4.2 s`, `3 min 05 s`, `2 h 07 min`) in seconds."""
    units = {"h": 3600, "min": 60, "s": 1}
    found = re.findall(r"([\d.]+) (h|min|s)\b", text)
    assert found, text
    return sum(float(amount) * units[unit] for amount, unit in found)


def cells(page: Page, css: str) -> dict[str, list[str]]:
    """A side-by-side table's rows: label -> each job's cell text."""
    found = {}
    for row in page.all(f"{css} tbody tr"):
        label = str(row.get_attribute("data-row"))
        found[label] = [cell.text for cell in row.find_elements("css selector", "td")]
    return found


def showing(page: Page, listing: dict[str, Any]) -> bool:
    return shown(page) == ids(listing)


def in_url(page: Page, text: str) -> bool:
    return text in page.driver.current_url


def differing(page: Page) -> set[str | None]:
    return {row.get_attribute("data-row") for row in page.all("table.compare tr.differs")}


def test_each_row_shows_its_method_and_run_time_and_the_list_its_total(
    page: Page, seeded: Seeded
) -> None:
    listing = seeded.get("/v1/jobs")
    page.open("/jobs")
    assert page.text("#jobs-total") == f"{listing['total']} jobs"
    assert listing["total"] > len(listing["items"]) or listing["next_cursor"] is None
    assert shown(page) == ids(listing)
    for job in listing["items"]:
        row = f'tr[data-job="{job["id"]}"]'
        assert page.text(f"{row} td.method") == (job["method"] or "")
        run_time = page.text(f"{row} td.duration")
        if job["duration_s"] is None:
            assert run_time == "", job
        else:
            assert "running" not in run_time
            assert abs(seconds(run_time) - job["duration_s"]) <= 0.1 * job["duration_s"] + 0.1
    merge_row = f'tr[data-job="{seeded.merge["id"]}"]'
    assert page.text(f"{merge_row} td.method") == "layer_swap"
    page.open("/jobs?kind=merge")
    assert page.text("#jobs-total") == f"{seeded.get('/v1/jobs?kind=merge')['total']} jobs"


def test_pages_go_forward_and_back_with_the_count_unchanged(page: Page, seeded: Seeded) -> None:
    first = seeded.get("/v1/jobs?limit=3")
    second = seeded.get(f"/v1/jobs?limit=3&cursor={first['next_cursor']}")
    page.open("/jobs?limit=3")
    assert shown(page) == ids(first)
    assert not page.driver.find_elements("link text", "Previous page")
    page.driver.find_element("link text", "Next page").click()
    page.settled()
    page.eventually("the second page", lambda: shown(page) == ids(second))
    assert page.text("#jobs-total") == f"{first['total']} jobs"
    page.driver.find_element("link text", "Previous page").click()
    page.settled()
    page.eventually("the first page again", lambda: shown(page) == ids(first))
    assert "before=" in page.driver.current_url
    assert not page.driver.find_elements("link text", "Previous page")


@pytest.mark.parametrize(
    ("field", "first"),
    [("status", "asc"), ("method", "asc"), ("duration", "desc"), ("created_at", "asc")],
)
def test_a_heading_sorts_the_list_in_the_api_s_order_both_ways(
    page: Page, seeded: Seeded, field: str, first: str
) -> None:
    page.open("/jobs?limit=5")
    for order in (first, "desc" if first == "asc" else "asc"):
        sorted_by = f"sort={field}&order={order}"
        page.click(f"th[data-sort={field}] a")
        page.eventually(f"{sorted_by} in the URL", partial(in_url, page, sorted_by))
        page.settled()
        wanted = seeded.get(f"/v1/jobs?limit=5&{sorted_by}")
        page.eventually(f"the list by {sorted_by}", partial(showing, page, wanted))
        aria = page.find(f"th[data-sort={field}]").get_attribute("aria-sort")
        assert aria == {"asc": "ascending", "desc": "descending"}[order]
        page.driver.find_element("link text", "Next page").click()
        page.settled()
        after = seeded.get(f"/v1/jobs?limit=5&{sorted_by}&cursor={wanted['next_cursor']}")
        page.eventually(f"the next page by {sorted_by}", partial(showing, page, after))
        assert not set(ids(after)) & set(ids(wanted))
        page.open(f"/jobs?limit=5&{sorted_by}")


def test_ticked_merges_open_side_by_side_with_differences_marked(
    page: Page, seeded: Seeded
) -> None:
    trials = [j for j in seeded.get("/v1/jobs?kind=merge&limit=200")["items"]
              if j["sweep_id"] == seeded.sweep["id"]]  # fmt: skip
    merges = [seeded.get(f"/v1/merges/{j['id']}") for j in trials]
    one = merges[0]
    recipe = ("params", "experts")
    two = next(m for m in merges if any(m["request"][k] != one["request"][k] for k in recipe))
    page.open("/jobs?kind=merge&limit=200")
    assert page.find("#compare").get_attribute("disabled") is not None
    page.click(f'input[name=select][value="{one["id"]}"]')
    page.click(f'input[name=select][value="{two["id"]}"]')
    page.eventually("Compare to turn on", lambda: page.find("#compare").is_enabled())
    page.click("#compare")
    page.eventually("the compare page", lambda: "#/compare?" in page.driver.current_url)
    page.settled()
    assert f"ids={one['id']}%2C{two['id']}" in page.driver.current_url
    heads = [th.get_attribute("data-job") for th in page.all("table.compare thead th[data-job]")]
    assert heads == [one["id"], two["id"]]
    rows = cells(page, "table.compare")
    assert rows["method"] == ["layer_swap", "layer_swap"]
    assert rows["status"] == ["succeeded", "succeeded"]
    marked = differing(page)
    assert "method" not in marked and "status" not in marked
    for key, value in one["request"]["params"].items():
        values = [m["request"]["params"][key] for m in (one, two)]
        if isinstance(value, (str, int, float, bool)):
            assert rows[f"params.{key}"] == [
                v if isinstance(v, str) else json.dumps(v) for v in values
            ]
            assert (f"params.{key}" in marked) == (values[0] != values[1]), key
    for role, names in one["request"]["experts"].items():
        label = f"source: experts.{role}[0]"
        assert rows[label] == [names[0], two["request"]["experts"][role][0]]
        assert (label in marked) == (rows[label][0] != rows[label][1])
    assert all(rows["output size"])
    shas = [{f["name"]: f["sha256"] for f in m["output"]["files"]} for m in (one, two)]
    label = "sha256: model.safetensors"
    assert rows[label] == [found["model.safetensors"][:12] for found in shas]
    assert label in marked, "two different recipes made different weights"
    page.screenshot("compare-merges")

    page.open(f"/compare?ids={two['id']},{one['id']}")  # shared: the kind found from the ids
    assert [
        th.get_attribute("data-job") for th in page.all("table.compare thead th[data-job]")
    ] == [two["id"], one["id"]]
    assert cells(page, "table.compare")[label] == [rows[label][1], rows[label][0]]


def test_evaluations_compare_their_scores_and_mixed_kinds_do_not(
    page: Page, seeded: Seeded
) -> None:
    expert, merged = seeded.expert_evaluation, seeded.evaluation
    page.open("/jobs?limit=200")
    page.click(f'input[name=select][value="{seeded.merge["id"]}"]')
    page.click(f'input[name=select][value="{expert["id"]}"]')
    page.eventually("a hint for mixed kinds", lambda: "two or more" in page.text("#compare-bar"))
    assert not page.find("#compare").is_enabled()
    page.click(f'input[name=select][value="{seeded.merge["id"]}"]')  # untick the merge
    page.click(f'input[name=select][value="{merged["id"]}"]')
    page.eventually("Compare to turn on", lambda: page.find("#compare").is_enabled())
    page.click("#compare")
    page.eventually("the compare page", lambda: "kind=evaluation" in page.driver.current_url)
    page.settled()
    rows = cells(page, "table.compare")
    for score in merged["result"]["scores"]:
        key = f"{score['task']} · {score['filter']} · {score['metric']}"
        same = (score["task"], score["filter"], score["metric"])
        other = next(
            s for s in expert["result"]["scores"] if (s["task"], s["filter"], s["metric"]) == same
        )
        assert [v.split(" ±")[0] for v in rows[key]] == [
            f"{other['value']:.4f}",
            f"{score['value']:.4f}",
        ]
        assert (key in differing(page)) == (rows[key][0] != rows[key][1])
    assert rows["merge"] == ["", seeded.merge["id"]]
    assert "merge" in differing(page)


def test_a_compare_url_without_two_ids_says_what_it_needs(page: Page) -> None:
    page.open("/compare?ids=only-one")
    assert "Give two to" in page.text("main [role=alert]")


def test_a_filter_keeps_the_order(page: Page, seeded: Seeded) -> None:
    page.open("/jobs?sort=status&order=asc")
    Select(page.find("select[name=kind]")).select_by_value("merge")
    page.eventually("the kind filter in the URL", partial(in_url, page, "kind=merge"))
    page.settled()
    assert "sort=status&order=asc" in page.driver.current_url
    wanted = seeded.get("/v1/jobs?kind=merge&sort=status&order=asc")
    page.eventually("the merges by status", partial(showing, page, wanted))
