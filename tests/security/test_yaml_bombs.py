"""YAML and JSON a tenant gives: a few hundred bytes of anchors and aliases that stand for
millions of values, nesting thousands deep, and requests whose stored form is large are
refused by their field, before anything expands or is stored, while the service goes on
answering. A real config with anchors within the bounds still runs. The loader's own bounds
are checked on both of PyYAML's parsers (libyaml's and the pure-Python one)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import func, select

from core.db.models import Job, Sweep
from core.db.session import Database
from engine.errors import RecipeError
from engine.schema import user_yaml
from engine.schema.user_yaml import MAX_DEPTH, MAX_VALUES, check_data, load_yaml
from tests.evaluation.conftest import MAX_GEN_TOKS, TASK, write_mgsm
from tests.helpers import leftovers, wait_for
from tests.service.conftest import Service, running_service
from tests.service.live import Live, live_service

LAYERSWAP = Path(sys.executable).parent / "layerswap"
LEVELS = 9  # of ten aliases each: 10**8 strings in about 550 bytes
CONFIG = """\
merge_method: linear
models:
  - model: math
    parameters: &weights {weight: 0.5}
  - model: swh
    parameters: *weights
dtype: float32
"""


def alias_bomb(levels: int = LEVELS) -> str:
    """A valid config, and under a key mergekit ignores, ten aliases a level, `levels` deep."""
    lines = [*CONFIG.splitlines(), 'l0: &l0 "lol"']
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 10) + "]")
    return "\n".join([*lines, f"notes: *l{levels - 1}"]) + "\n"


def sliced(count: int) -> str:
    """A passthrough config of `count` one-layer slices, written with anchors as people do."""
    lines = ["merge_method: passthrough", "dtype: bfloat16", "slices:"]
    for i in range(count):
        model = f"&m{i} org/model-{i}" if i < 2 else f"*m{i % 2}"
        lines += [
            "  - sources:",
            f"      - model: {model}",
            f"        layer_range: [{i % 32}, {i % 32 + 1}]",
        ]
    return "\n".join(lines) + "\n"


@pytest.fixture(params=["libyaml", "python"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of PyYAML's parsers in turn (libyaml's where PyYAML was built with it)."""
    if request.param == "python":
        monkeypatch.setattr(user_yaml, "_LOADER", yaml.SafeLoader)
    elif not getattr(yaml, "__with_libyaml__", False):
        pytest.skip("PyYAML without libyaml")
    return str(request.param)


def refused(text: str, *words: str) -> RecipeError:
    with pytest.raises(RecipeError) as caught:
        load_yaml(text, "mergekit")
    error = caught.value
    assert error.details["field"] == "mergekit"
    assert error.message.startswith("mergekit: ")
    for word in words:
        assert word in error.message, error.message
    assert "\n" not in error.message and len(error.message) < 400
    return error


# -- the loader -------------------------------------------------------------------------------
def test_an_alias_bomb_is_refused_before_it_expands(parser: str) -> None:
    error = refused(alias_bomb(), "YAML aliases expand to more than", "without anchors")
    assert error.details["line"] > 1  # where: the first node that grew past the bound


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        "{a: " * 20_000 + "1" + "}" * 20_000,
        "".join(" " * i + "- \n" for i in range(2_000)),
        "".join(" " * i + "a:\n" for i in range(2_000)),
    ],
    ids=["flow-lists", "flow-mappings", "block-lists", "block-mappings"],
)
def test_deep_nesting_is_refused_without_recursion(parser: str, text: str) -> None:
    refused(text, f"nested more than {MAX_DEPTH} levels deep", "line ")


def test_aliases_cannot_nest_a_document_deeper_than_written(parser: str) -> None:
    deep = "[" * 60 + "1" + "]" * 60
    refused(f"a: &a {deep}\nb: {'[' * 10}*a{']' * 10}\n", "with its aliases written out")
    assert load_yaml(f"a: &a {deep}\nb: *a\n", "mergekit")["b"] == load_yaml(deep, "x")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("&a [1, *a]", "refers to the anchor it is inside of"),
        ("a: &a {b: *a}", "refers to the anchor it is inside of"),
        ("[" + ", ".join(["0"] * (MAX_VALUES + 1)) + "]", f"holds more than {MAX_VALUES} values"),
        ("a: " + "x" * (user_yaml.MAX_TEXT + 1), "holds more than 1024 KiB of text"),
        ('a: "x\\0y"', "NUL"),
        ("a: 2024-13-01", "not valid YAML: month must be in 1..12"),
        ("a: " + "1" * 5000, "not valid YAML: Exceeds the limit"),
        ("merge_method: [linear", "not valid YAML"),
        ("a: 1\n---\nb: 2\n", "not valid YAML"),
    ],
    ids=["self-list", "self-mapping", "values", "text", "nul", "date", "int", "syntax", "two"],
)
def test_what_cannot_be_read_is_one_line_naming_the_field(
    parser: str, text: str, words: str
) -> None:
    refused(text, words)


def test_merge_keys_count_what_they_merge(parser: str) -> None:
    """`<<: [*a, *a, ...]` copies the merged pairs into each mapping: as much as aliases."""
    lines = ["a0: &a0 {x: 1, y: 2}"]
    for level in range(1, 8):
        lines.append(f"a{level}: &a{level} {{<<: [" + ", ".join([f"*a{level - 1}"] * 10) + "]}")
    refused("\n".join(lines), "YAML aliases expand")
    assert load_yaml("a: &a {x: 1}\nb: {<<: *a, y: 2}", "m")["b"] == {"x": 1, "y": 2}


def test_a_real_config_with_anchors_loads_as_pyyaml_reads_it(parser: str) -> None:
    text = sliced(256)  # a deep frankenmerge: far under every bound
    loaded = load_yaml(text, "mergekit")
    assert loaded == yaml.safe_load(text)
    assert loaded["slices"][255]["sources"][0]["model"] == "org/model-1"
    assert load_yaml(alias_bomb(3), "mergekit")["notes"] == [["lol"] * 10] * 10
    assert load_yaml("", "mergekit") is None


def test_a_mapping_is_held_to_the_same_rule() -> None:
    deep: Any = 1
    for _ in range(10_000):  # deeper than Python's recursion limit
        deep = [deep]
    for value, words in [
        (deep, f"nested more than {MAX_DEPTH} levels deep"),
        ({"notes": [0] * (MAX_VALUES + 1)}, f"holds more than {MAX_VALUES} values"),
        ({"notes": "x" * (user_yaml.MAX_TEXT + 1)}, "1024 KiB of text"),
    ]:
        with pytest.raises(RecipeError) as caught:
            check_data(value, "mergekit")
        assert caught.value.details == {"field": "mergekit"}
        assert words in caught.value.message
    # Each slice: its mapping, `sources`, the list, a source's mapping, `model` and the name,
    # `layer_range`, the list and two numbers (10); the config's mapping, 3 keys, 2 values and
    # the list of slices (7). Nested: config, slices, a slice, sources, a source, its range.
    size = check_data(yaml.safe_load(sliced(256)), "mergekit")
    assert (size.values, size.depth) == (7 + 10 * 256, 6)


# -- over HTTP, on SQLite and PostgreSQL ------------------------------------------------------
@pytest.fixture
def live(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Live]:
    with live_service(tmp_path, database_url, examples) as running:
        yield running


def stored_jobs(live: Live) -> int:
    db = Database(str(live.settings.database))
    try:
        with db.session() as session:
            return int(session.scalar(select(func.count()).select_from(Job)) or 0)
    finally:
        db.dispose()


def post(live: Live, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/merges", json=body, timeout=120, trust_env=False)


def assert_refused(response: httpx.Response, status: int, code: str, words: str) -> None:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert (error["code"], error["details"]["field"]) == (code, "mergekit"), error
    assert words in error["message"], error
    assert len(response.content) < 2000  # the answer does not repeat the input


def test_an_alias_bomb_is_refused_while_the_service_answers(live: Live) -> None:
    with ThreadPoolExecutor(1) as pool:
        bomb = pool.submit(post, live, {"mergekit": alias_bomb()})
        health = httpx.get(f"{live.url}/healthz", timeout=60, trust_env=False)
        answer = bomb.result()
    assert health.status_code == 200
    assert_refused(answer, 422, "invalid_request", "YAML aliases expand to more than")
    assert stored_jobs(live) == 0
    listed = httpx.get(f"{live.url}/v1/merges", timeout=60, trust_env=False)
    assert listed.status_code == 200 and listed.json()["items"] == []


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ("[" * 10_000 + "]" * 10_000, "nested more than 64 levels deep (line 1, column 65)"),
        ({"merge_method": "linear", "notes": [0] * (MAX_VALUES + 1)}, "more than 100000 values"),
    ],
    ids=["yaml-text", "json-mapping"],
)
def test_what_exceeds_the_bounds_is_422_naming_mergekit(
    live: Live, config: Any, words: str
) -> None:
    assert_refused(post(live, {"mergekit": config}), 422, "invalid_request", words)
    assert stored_jobs(live) == 0


def test_a_config_with_anchors_runs_and_ignored_keys_are_not_stored(live: Live) -> None:
    text = CONFIG + f"notes: &n {'x' * 50_000}\nmore_notes: [*n, *n]\n"
    response = post(live, {"mergekit": text})
    assert response.status_code == 202, response.text[:500]
    job = response.json()
    assert job["request"]["params"]["weights"] == [0.5, 0.5]
    record = job["request"]["mergekit"]
    assert record["config"] == yaml.safe_load(CONFIG)
    assert (
        "notes: not a field of mergekit's config; ignored, as mergekit does" in (record["warnings"])
    )
    assert len(response.content) < 10_000  # the notes went nowhere
    done = wait_for_end(live, job["id"])
    assert done["status"] == "succeeded", done["error"]
    manifest = json.loads((Path(done["output"]["location"]) / "layerswap.json").read_text())
    assert manifest["mergekit_config"] == record["config"]


def wait_for_end(live: Live, job_id: str) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        found = httpx.get(f"{live.url}/v1/merges/{job_id}", timeout=60, trust_env=False).json()
        return found if found["status"] in ("succeeded", "failed", "canceled") else None

    return wait_for(ended, f"merge {job_id} to end", 120, interval=0.05)


def test_a_request_too_large_to_store_is_413_and_nothing_is_stored(live: Live) -> None:
    """A parameter mergekit ignores is kept in the config (it is the config's); 300 KB of it
    passes the YAML bounds and the body limit, and would make every view of the job large."""
    config = yaml.safe_load(CONFIG)
    config["models"][0]["parameters"] = {"weight": 0.5, "notes": "x" * 300_000}
    limit = live.settings.max_stored_request_bytes
    assert_refused(post(live, {"mergekit": config}), 413, "request_too_large", f"at most {limit}")
    assert stored_jobs(live) == 0


# -- the command line -------------------------------------------------------------------------
def layerswap(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LAYERSWAP), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def test_layerswap_merge_refuses_a_bomb_in_one_line(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb(), encoding="utf-8")
    deep = tmp_path / "deep.yaml"
    deep.write_text("method: soup\nmodels: " + "[" * 50_000 + "]" * 50_000, encoding="utf-8")
    for path, words in ((bomb, "YAML aliases expand"), (deep, "nested more than 64 levels")):
        out = tmp_path / "merged"
        proc = layerswap("merge", path, "--out", out, cwd=tmp_path)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr[:2000]
        assert lines[0].startswith("layerswap: error [invalid_recipe]: recipe: ")
        assert path.name in lines[0] and words in lines[0], lines[0]
        assert leftovers(out) == []


def test_layerswap_submit_refuses_a_bomb_before_sending_it(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb(), encoding="utf-8")
    # Nothing listens on port 9: only a refusal before any request ends this way.
    proc = layerswap("submit", bomb, "--server", "http://127.0.0.1:9", cwd=tmp_path)
    assert proc.returncode == 2
    assert "YAML aliases expand" in proc.stderr and "cannot reach" not in proc.stderr


# -- sweeps ----------------------------------------------------------------------------------
@contextmanager
def sweeps(tmp_path: Path, examples: Path, **overrides: Any) -> Iterator[Service]:
    data = tmp_path / "eval-data"
    write_mgsm(data, ["4"] * 8, [True] * 8)  # the task's data: no sweep here runs
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples, eval_data_dir=data,
        **overrides,
    ) as running:  # fmt: skip
        yield running


def sweep_body(task_expert: str) -> dict[str, Any]:
    return {
        "task_experts": [task_expert],
        "language_experts": ["swh"],
        "base": "base",
        "configurations": [{"bottom": 1, "top": 1}],
        "evaluation": {"tasks": [TASK], "num_fewshot": 0, "max_gen_toks": MAX_GEN_TOKS},
        "objective": {"task": TASK, "metric": "exact_match", "filter": "remove_whitespace"},
    }


def test_a_sweeps_config_json_nested_too_deep_is_422(tmp_path: Path, examples: Path) -> None:
    """An expert's config.json is anyone's (a Hub repository's): read within bounds."""
    with sweeps(tmp_path, examples) as service:
        deep = service.checkpoints / "deep"
        deep.mkdir()
        (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
        response = service.client.post("/v1/sweeps", json=sweep_body("deep"))
    assert response.status_code == 422, response.text[:500]
    assert response.json()["error"]["details"]["field"] == "task_experts.0"


def test_a_sweep_too_large_to_store_is_413(tmp_path: Path, examples: Path) -> None:
    """Stored, this spec is about 1,100 bytes of JSON: over the operator's 1,024."""
    body = sweep_body("math") | {"configurations": [{"bottom": b, "top": 1} for b in (1, 2, 3)]}
    with sweeps(tmp_path, examples, max_stored_request_bytes=1024) as service:
        response = service.client.post("/v1/sweeps", json=body)
        with service.db.session() as session:
            stored = [session.scalar(select(func.count()).select_from(t)) for t in (Sweep, Job)]
    assert response.status_code == 413, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert error["details"] == {"field": "configurations", "limit": 1024}
    assert stored == [0, 0]
