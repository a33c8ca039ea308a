"""The web console's jobs page over a large store: how soon it paints, and that it stays paged.

For each store (SQLite, the embedded default; PostgreSQL) it makes one data set: a few real
submits of each kind (a layer swap, an evaluation, an analysis; held queued: no executor runs
them) and copies of their rows with new ids, each a little older, up to `--jobs` jobs. One API
(uvicorn on loopback, in this process) serves it, and:

    server   GET /v1/jobs (the jobs page's one data request: the newest 50), --reps times in a
             row: median and p95 latency; the same for a page deep in the list (after walking
             --deep pages by cursor); and the console's static files (/ui/, its CSS and
             modules), all of them, once
    browser  headless Chromium (Debian's chromium + chromium-driver) opens /ui/#/jobs afresh
             --reps times: first paint and first contentful paint (the Paint Timing API), and
             the jobs table rendered (the console's own `layerswap:rendered` mark), from the
             navigation's start; the first load cold (nothing cached), the rest warm
    paged    every request the page made (Resource Timing): each /v1/jobs request must carry no
             limit above 50 (the API holds a page to at most 50 unless asked for more, and
             to 200 whatever is asked); the only other requests may be a running merge's own
             event stream; the page must show 50 rows and a link to the next page

The report goes to bench/figures/console-<git short sha>.md.

    .venv/bin/python bench/console.py --store both
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import uvicorn
from sqlalchemy import MetaData, Table, create_engine, select, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.db.migrate import upgrade
from core.settings import Settings
from service.app import create_app
from worker.examples import make_examples

ROOT = Path(__file__).resolve().parent
PAGE = 50  # the jobs page's page size (the API's default)
EVALUATION = {"tasks": ["mgsm_direct_sw"], "num_fewshot": 0, "limit": 4}
POSTGRES_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


class Held:
    """An executor that runs nothing: the jobs stay queued (the page lists them all the same),
    each one held as waiting for a worker, so the reconciler leaves them be."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.held: set[str] = set()

    def start(self) -> None:
        engine = create_engine(self.url)
        with engine.connect() as connection:
            self.held = set(connection.scalars(text("SELECT id FROM jobs")))
        engine.dispose()

    def dispatch(self, job_id: str, kind: str) -> None:
        self.held.add(job_id)

    def pending(self) -> set[str]:
        return self.held

    def stop(self) -> None: ...


@contextlib.contextmanager
def database(store: str, scratch: Path) -> Iterator[str]:
    if store == "sqlite":
        yield f"sqlite:///{scratch / 'layerswap.db'}"
        return
    name = f"layerswap_console_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield POSTGRES_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextlib.contextmanager
def serving(settings: Settings) -> Iterator[str]:
    app = create_app(settings, executor=Held(settings.database))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def seed(base: str) -> None:
    """One real submit of each kind (held queued)."""
    with httpx.Client(base_url=base, timeout=60) as client:
        bodies = [
            ("/v1/merges", {"method": "layer_swap", "experts": {"task": ["math"],
             "language": ["swh"]}, "params": {"bottom": 1, "top": 1}}),
            ("/v1/evaluations", {"source": "math", "evaluation": EVALUATION}),
            ("/v1/analyses", {"base": "base", "experts": [{"label": "m", "path": "math"}]}),
        ]  # fmt: skip
        for path, body in bodies:
            response = client.post(path, json=body)
            response.raise_for_status()


def clone_jobs(url: str, total: int) -> None:
    """Copies of the store's jobs (new ids, each a second older) until it holds `total`."""
    engine = create_engine(url)
    try:
        jobs = Table("jobs", MetaData(), autoload_with=engine)
        with engine.begin() as connection:
            originals = [dict(row._mapping) for row in connection.execute(select(jobs))]
            copies: list[dict[str, Any]] = []
            for n in range(total - len(originals)):
                row = dict(originals[n % len(originals)])
                row["id"], row["idempotency_key"] = uuid.uuid4().hex, None
                row["created_at"] = row["created_at"] - timedelta(seconds=n + 1)
                copies.append(row)
            for at in range(0, len(copies), 1000):
                connection.execute(jobs.insert(), copies[at : at + 1000])
    finally:
        engine.dispose()


def timed(client: httpx.Client, path: str, reps: int) -> list[float]:
    found = []
    for _ in range(reps):
        started = time.perf_counter()
        client.get(path).raise_for_status()
        found.append((time.perf_counter() - started) * 1000)
    return found


def server_figures(base: str, reps: int, deep: int) -> dict[str, Any]:
    with httpx.Client(base_url=base, timeout=60) as client:
        first = timed(client, "/v1/jobs", reps)
        cursor = None
        for _ in range(deep):  # or as deep as the list goes
            page = client.get("/v1/jobs", params={"cursor": cursor} if cursor else {}).json()
            if page["next_cursor"] is None:
                break
            cursor = page["next_cursor"]
        deep_times = timed(client, f"/v1/jobs?cursor={cursor}", reps)
        index = client.get("/ui/").text
        files = ["/ui/", "/ui/console.css", "/ui/js/app.js", "/ui/js/api.js", "/ui/js/dom.js",
                 "/ui/js/charts.js", *(f"/ui/js/pages/{p.name}" for p in
                 sorted((ROOT.parent / "service/console/js/pages").glob("*.js")))]  # fmt: skip
        started = time.perf_counter()
        size = sum(len(client.get(f).content) for f in files)
        static_ms = (time.perf_counter() - started) * 1000
        assert "js/app.js" in index
    return {"first": first, "deep": deep_times, "static_ms": static_ms, "static_bytes": size,
            "files": len(files)}  # fmt: skip


def browser_figures(base: str, reps: int) -> dict[str, Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,900"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(
        options=options, service=DriverService(executable_path=shutil.which("chromedriver"))
    )
    loads = []
    try:
        # Chromium in a container may see its network "change" on its first connection
        # (ERR_NETWORK_CHANGED): one unmeasured visit of another URL first.
        for _ in range(3):
            driver.get(f"{base}/healthz")
            if "ok" in driver.page_source:
                break
        for _ in range(reps):
            for _attempt in range(3):  # a load cut by ERR_NETWORK_CHANGED is loaded again
                driver.get("about:blank")
                driver.get(f"{base}/ui/#/jobs")
                if rendered(driver):
                    break
            loads.append(driver.execute_script(
                "const paint = Object.fromEntries(performance.getEntriesByType('paint')"
                "  .map(e => [e.name, e.startTime]));"
                "return {paint, rendered: performance.getEntriesByName('layerswap:rendered')[0]"
                "  .startTime, rows: document.querySelectorAll('table.jobs tbody tr').length,"
                "  next: !!Array.from(document.querySelectorAll('.pager a'))"
                "    .find(a => a.textContent === 'Next page'),"
                "  requests: performance.getEntriesByType('resource').map(e => ({name: e.name,"
                "    bytes: e.encodedBodySize}))}"
            ))  # fmt: skip
    finally:
        driver.quit()
    return {"loads": loads}


def rendered(driver: Any) -> bool:
    """Whether the jobs page rendered (False: Chromium showed a network error page)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if driver.execute_script(
            "return performance.getEntriesByName('layerswap:rendered').length"
        ):
            return True
        if "ERR_" in driver.execute_script("return document.body.innerText"):
            return False
        time.sleep(0.01)
    raise AssertionError("the jobs page did not render in 60 s")


def paged(browser: dict[str, Any]) -> list[str]:
    """What breaks the promise that the page reads one page of jobs (empty: nothing)."""
    problems = []
    for load in browser["loads"]:
        if load["rows"] != PAGE or not load["next"]:
            problems.append(f"{load['rows']} rows shown, next link: {load['next']}")
        for request in load["requests"]:
            parts = urlsplit(request["name"])
            if not parts.path.startswith("/v1/"):
                continue
            limit = int(parse_qs(parts.query).get("limit", [str(PAGE)])[0])
            one_job = parts.path.startswith("/v1/merges/") and parts.path.endswith("/events")
            if not one_job and (parts.path != "/v1/jobs" or limit > PAGE):
                problems.append(f"request {request['name']}")
    return problems


def median(values: list[float]) -> float:
    return statistics.median(values)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def measure(store: str, jobs: int, reps: int, deep: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        make_examples(scratch / "data" / "checkpoints")
        with database(store, scratch) as url:
            settings = Settings(data_dir=scratch / "data", database_url=url,
                                allowed_roots=[scratch / "data" / "checkpoints"])  # fmt: skip
            upgrade(settings.database)
            with serving(settings) as base:
                seed(base)
            clone_jobs(url, jobs)
            with serving(settings) as base:  # a fresh process state: nothing kept
                browser = browser_figures(base, reps)
                server = server_figures(base, reps * 10, deep)
    return {"store": store, "server": server, "browser": browser, "problems": paged(browser)}


def report(results: list[dict[str, Any]], jobs: int, commit: str) -> str:
    lines = [
        f"# Console jobs page, {jobs} jobs in the store (commit {commit})",
        "",
        "| store | GET /v1/jobs p50 / p95 ms | deep page p50 ms | static files | "
        "first paint ms (cold / warm) | first contentful paint ms (cold / warm) | "
        "table rendered ms (cold / warm) | bytes of jobs per load | paged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        server, loads = result["server"], result["browser"]["loads"]
        cold, warm = loads[0], loads[1:] or loads

        def both(read: Any, cold: Any = cold, warm: Any = warm) -> str:
            return f"{read(cold):.0f} / {median([read(w) for w in warm]):.0f}"

        jobs_bytes = max(
            sum(r["bytes"] for r in load["requests"] if "/v1/jobs" in r["name"]) for load in loads
        )
        lines.append(
            f"| {result['store']} | {median(server['first']):.1f} / {p95(server['first']):.1f} "
            f"| {median(server['deep']):.1f} | {server['files']} files, "
            f"{server['static_bytes'] / 1024:.0f} KiB in {server['static_ms']:.0f} ms "
            f"| {both(lambda x: x['paint'].get('first-paint', 0))} "
            f"| {both(lambda x: x['paint'].get('first-contentful-paint', 0))} "
            f"| {both(lambda x: x['rendered'])} | {jobs_bytes / 1024:.1f} KiB "
            f"| {'yes' if not result['problems'] else '; '.join(result['problems'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--deep", type=int, default=100, help="pages walked for the deep page")
    args = parser.parse_args()
    stores = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    results = [measure(store, args.jobs, args.reps, args.deep) for store in stores]
    asked = ["git", "rev-parse", "--short", "HEAD"]
    found = subprocess.run(asked, capture_output=True, text=True, cwd=ROOT, check=False)
    commit = found.stdout.strip() or "unknown"
    text_report = report(results, args.jobs, commit)
    (ROOT / "figures").mkdir(exist_ok=True)
    (ROOT / "figures" / f"console-{commit}.md").write_text(text_report)
    print(text_report)
    if any(result["problems"] for result in results):
        sys.exit("the jobs page read more than one page of jobs")


if __name__ == "__main__":
    main()
