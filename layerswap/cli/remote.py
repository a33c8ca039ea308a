"""The remote command line: `layerswap submit | status | wait | lineage` against a running
service, through the Python client (layerswap_client). The server is --server, LAYERSWAP_URL
or the embedded default's address; the key is LAYERSWAP_API_KEY."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import click
import httpx
from tqdm import tqdm

from engine.errors import RecipeError
from engine.schema.parts import Arithmetic
from engine.schema.user_yaml import load_yaml
from layerswap_client import Client, LayerswapError

KINDS = {"merge": "merges", "evaluation": "evaluations", "analysis": "analyses"}
EXIT_FAILED, EXIT_ERROR = 1, 2

server_option = click.option(
    "--server", envvar="LAYERSWAP_URL", default="http://127.0.0.1:8000", show_default=True,
    help="The service's URL (or LAYERSWAP_URL).",
)  # fmt: skip
kind_option = click.option(
    "--kind", type=click.Choice(sorted(KINDS)), default="merge", show_default=True,
    help="What the job is.",
)  # fmt: skip


@contextmanager
def remote(server: str) -> Iterator[Any]:
    """A client for `server`; the service's errors and unreachable servers become a message
    on stderr and exit status 2."""
    try:
        with Client(server) as client:
            yield client
    except LayerswapError as e:
        click.echo(f"error: {e.status} {e.code}: {e.message}", err=True)
        if e.details:
            click.echo(f"       {json.dumps(e.details)}", err=True)
        sys.exit(EXIT_ERROR)
    except httpx.TransportError as e:
        click.echo(f"error: cannot reach {server}: {e}", err=True)
        sys.exit(EXIT_ERROR)


def summary(job: Any) -> dict[str, Any]:
    found = {"id": job.id, "kind": job.kind, "status": job.status, "stage": job.stage}
    if job.progress is not None:
        found["progress"] = job.progress.model_dump(include={"unit", "done", "total", "fraction"})
    if job.output is not None:
        found["artifact_id"] = job.output.artifact_id
        found["location"] = job.output.location
    if job.error:
        found["error"] = job.error
    return found


def follow(client: Any, collection: str, job_id: str, *, quiet: bool) -> Any:
    """Wait for the job: a live progress bar from the event stream for merges, polling for the
    other kinds. Returns the ended job."""
    jobs = getattr(client, collection)
    if collection != "merges":
        return jobs.wait(job_id, poll_s=1.0)
    with tqdm(total=0, unit="B", unit_scale=True, desc="merging", disable=quiet) as bar:
        for event in jobs.events(job_id):
            if event.type == "progress":
                bar.total = event.data.get("bytes_total") or bar.total
                bar.set_description(event.data.get("stage") or "merging")
                bar.update(int(event.data.get("bytes_done", 0)) - bar.n)
            elif event.type in ("succeeded", "failed", "canceled"):
                if event.type == "succeeded":
                    bar.update(int(bar.total or 0) - bar.n)
                break
    return jobs.get(job_id)


def ended(job: Any) -> None:
    click.echo(json.dumps(summary(job), indent=2, default=str))
    if job.status != "succeeded":
        sys.exit(EXIT_FAILED)


@click.command()
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@server_option
@kind_option
@click.option("--wait", "wait_", is_flag=True, help="Follow the job until it ends.")
@click.option("--idempotency-key", help="Resubmitting with the same key returns the same job.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--arithmetic",
    type=click.Choice(get_args(Arithmetic)),
    help="A merge's arithmetic dtype, replacing the recipe's or a mergekit config's `dtype`.",
)
def submit(
    recipe: Path, server: str, kind: str, wait_: bool, idempotency_key: str | None, quiet: bool,
    arithmetic: str | None,
) -> None:  # fmt: skip
    """Submit RECIPE (YAML or JSON: a merge recipe or mergekit config, or an evaluation /
    analysis request) to a running service; prints the job id, or with --wait the ended job
    (exit 1 unless it succeeded)."""
    body = read_body(recipe)
    if kind == "merge" and "merge_method" in body:  # a mergekit config: the service translates
        body = {"mergekit": body}
    if arithmetic is not None:
        if kind != "merge":
            raise click.UsageError("--arithmetic is a merge's")
        body["arithmetic"] = arithmetic
    with remote(server) as client:
        jobs = getattr(client, KINDS[kind])
        job = jobs.create(body, idempotency_key=idempotency_key)
        if not wait_:
            click.echo(job.id)
            return
        click.echo(f"{kind} {job.id} {job.status}", err=True)
        ended(follow(client, KINDS[kind], job.id, quiet=quiet))


def read_body(recipe: Path) -> dict[str, Any]:
    """The request in a YAML or JSON file, read within the bounds the service sets on YAML
    (aliases, nesting, size: engine/schema/user_yaml.py)."""
    try:
        body = load_yaml(recipe.read_text(encoding="utf-8"), "recipe", name=str(recipe))
    except RecipeError as e:
        raise click.BadParameter(e.message, param_hint="RECIPE") from None
    except UnicodeDecodeError as e:
        raise click.BadParameter(f"not UTF-8 text ({e.reason})", param_hint="RECIPE") from None
    if not isinstance(body, dict):
        raise click.BadParameter("must hold a mapping", param_hint="RECIPE")
    return body


@click.command()
@click.argument("job_id")
@server_option
@kind_option
def status(job_id: str, server: str, kind: str) -> None:
    """A job's status, stage, progress, output and error, as JSON."""
    with remote(server) as client:
        click.echo(
            json.dumps(summary(getattr(client, KINDS[kind]).get(job_id)), indent=2, default=str)
        )


@click.command()
@click.argument("job_id")
@server_option
@kind_option
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def wait(job_id: str, server: str, kind: str, quiet: bool) -> None:
    """Follow a job until it ends, with a live progress bar (merges: from the service's event
    stream); exit 1 unless it succeeded."""
    with remote(server) as client:
        ended(follow(client, KINDS[kind], job_id, quiet=quiet))


@click.command()
@click.argument("artifact_id")
@server_option
@click.option("--direction", type=click.Choice(["ancestors", "descendants"]), default="ancestors",
              show_default=True)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="The whole graph as JSON.")
def lineage(artifact_id: str, server: str, direction: str, as_json: bool) -> None:
    """The artifacts and jobs an artifact came from (or led to)."""
    with remote(server) as client:
        graph = client.artifacts.lineage(artifact_id, direction=direction)
    if as_json:
        click.echo(json.dumps(graph, indent=2, default=str))
        return
    artifacts = {a["id"]: a for a in graph["artifacts"]}
    for job in graph["jobs"]:
        what = ", ".join(str(v) for v in (job.get("kind"), job.get("method")) if v)
        click.echo(f"job {job['job_id']} ({what})")
        for edge in job.get("inputs", []):
            where = artifacts.get(edge["artifact_id"], {}).get("location", edge["artifact_id"])
            click.echo(f"  in   {edge.get('role', ''):>9}  {where}")
        for edge in job.get("outputs", []):
            where = artifacts.get(edge["artifact_id"], {}).get("location", edge["artifact_id"])
            click.echo(f"  out  {edge.get('role', ''):>9}  {where}")
