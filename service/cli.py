"""The `layerswap` command line: merge, analyze, examples, serve, worker, keys, db.

Heavy modules (torch, the engine) are imported inside commands so `--help` stays instant.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import yaml

from service.remote_cli import add_remote_commands

if TYPE_CHECKING:
    from service.settings import Settings


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Layerswap: merge fine-tuned LLM checkpoints (layer swap, soup, task arithmetic, TIES)."""


@contextmanager
def engine_errors() -> Iterator[None]:
    """Every expected failure ends as one line on stderr and a non-zero exit code."""
    from worker.engine.errors import EngineError

    try:
        yield
    except EngineError as e:
        click.echo(f"layerswap: error [{e.code}]: {e.message}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("layerswap: interrupted; no output was left behind", err=True)
        sys.exit(130)


def load_recipe_file(path: Path) -> Any:
    from worker.engine.errors import RecipeError
    from worker.engine.recipe import parse_recipe

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RecipeError.for_field("recipe", f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:  # its str() spans several lines; the CLI promises one
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError.for_field(
            "recipe", f"{path} is not valid YAML{where}: {problem}"
        ) from None
    return parse_recipe(data)


def local_resolver(root: Path) -> Callable[[str], Path]:
    """Recipe sources are directories, relative to the recipe file."""
    from worker.engine.planner import reject_unknown_source

    def resolve(source: str) -> Path:
        reject_unknown_source(source)
        return (root / source).resolve()

    return resolve


@cli.command()
@click.argument("recipe_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--dry-run", is_flag=True, help="Print the per-layer plan and write nothing.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--no-fsync", is_flag=True, help="Skip fsync before publishing (faster, less safe).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def merge(
    recipe_file: Path,
    out_dir: Path,
    dry_run: bool,
    device: str,
    overwrite: bool,
    no_fsync: bool,
    quiet: bool,
) -> None:
    """Merge the checkpoints named in RECIPE_FILE (YAML) into --out."""
    with engine_errors():
        from worker.engine.merge import MergeOptions
        from worker.engine.merge import merge as run_merge
        from worker.engine.planner import make_plan
        from worker.hub.fetch import fetch_inputs, hub_sources
        from worker.hub.pin import pin_recipe

        recipe = load_recipe_file(recipe_file)
        if recipe.output.mlflow is not None:
            raise click.UsageError(
                "output.mlflow registers a merge made by the service (POST /v1/merges); "
                "the local command does not"
            )
        local = local_resolver(recipe_file.parent)
        fetched = None
        if hub_sources(recipe):  # pinned now: a branch moving mid-run changes nothing
            recipe, pins = pin_recipe(recipe, hub_token(recipe.credential))
            for pinned in pins:
                click.echo(f"{pinned.repo}@{pinned.revision} -> commit {pinned.sha}", err=True)
            fetched = fetch_inputs(
                recipe,
                cache_dir=cache_dir() / "hub",
                token=hub_token(recipe.credential),
                local=local,
                headers_only=dry_run,
            )
        try:
            resolve = fetched.resolver(local) if fetched else local
            if dry_run:
                plan = make_plan(recipe, resolve=resolve)
                plan.close()
                click.echo(plan.table())
                return
            options = MergeOptions(
                device=device,
                durable=not no_fsync,
                overwrite=overwrite,
                hash_cache=cache_dir() / "sha256",
                known_digests=fetched.digests if fetched else {},
            )
            with progress_bar(disabled=quiet) as on_progress:
                result = run_merge(
                    recipe, out_dir, resolve=resolve, options=options, on_progress=on_progress
                )
        finally:
            if fetched is not None:
                fetched.close()
        for warning in result.manifest["warnings"]:
            click.echo(f"warning: {warning}", err=True)
        size = sum((result.out_dir / name).stat().st_size for name in result.files)
        click.echo(
            f"merged into {result.out_dir} ({len(result.files)} files, {size / 1e9:.3f} GB) "
            f"in {result.seconds:.1f} s; plan {result.plan_digest[:12]}"
        )
        if recipe.output.hub is not None:
            from worker.hub.publish import publish

            dest = recipe.output.hub
            published = publish(
                result.out_dir,
                dest,
                token=hub_token(dest.credential),
                job_id=f"cli-{result.plan_digest[:12]}",
                digests=result.files,
            )
            click.echo(f"published to {published.url}")


def hub_token(credential: str | None) -> str | None:
    """The CLI's Hub token: the named credential of the default tenant (LAYERSWAP_DEFAULT_TENANT,
    "default") in LAYERSWAP_HUB_CREDENTIALS, else HF_TOKEN (the user's own), else none (public
    repositories only)."""
    import os

    from worker.hub.credentials import token_for

    if credential is None:
        return os.environ.get("HF_TOKEN") or None
    settings = load_settings()
    return token_for(
        credential, tenant=settings.default_tenant, credentials=settings.hub_credentials
    )


def cache_dir() -> Path:
    """The CLI's cache: input sha256s and Hub downloads (LAYERSWAP_CACHE_DIR, else XDG)."""
    import os

    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("LAYERSWAP_CACHE_DIR") or Path(root) / "layerswap")


@contextmanager
def progress_bar(*, disabled: bool) -> Iterator[Callable[[Any], None]]:
    from tqdm import tqdm

    # Created on the first report, so a merge that fails while planning prints only its error.
    bar: tqdm[Any] | None = None

    def update(p: Any) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(
                total=p.bytes_total, unit="B", unit_scale=True, disable=disabled, desc="merging"
            )
        bar.total = p.bytes_total
        bar.set_postfix_str(f"{p.tensors_done}/{p.tensors_total} tensors", refresh=False)
        bar.update(p.bytes_done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


@cli.command()
@click.argument("model_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--tasks", required=True, help="Comma-separated lm-eval task names.")
@click.option("--limit", type=int, help="Documents per task (default: all).")
@click.option("--num-fewshot", type=int, default=8, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--max-gen-toks", type=int, default=256, show_default=True)
@click.option(
    "--tasks-dir",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="Extra task YAMLs (as LAYERSWAP_EVAL_TASKS_DIR).",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Local evaluation data (as LAYERSWAP_EVAL_DATA_DIR; default ./eval-data).",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N")
@click.option(
    "--samples",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write per-sample records (JSON lines) here.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def evaluate(
    model_dir: Path,
    tasks: str,
    limit: int | None,
    num_fewshot: int,
    batch_size: int,
    max_gen_toks: int,
    tasks_dir: Path | None,
    data_dir: Path | None,
    device: str,
    samples: Path | None,
    quiet: bool,
) -> None:
    """Evaluate the checkpoint in MODEL_DIR with lm-eval (the service's own code path)."""
    from pydantic import ValidationError
    from tqdm import tqdm

    from service.errors import ServiceError
    from worker.evaluation.results import write_samples
    from worker.evaluation.runner import evaluate as run_evaluation
    from worker.evaluation.spec import EvaluationSpec
    from worker.evaluation.tasks import check_tasks

    try:
        spec = EvaluationSpec(
            tasks=[t.strip() for t in tasks.split(",") if t.strip()],
            limit=limit,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            max_gen_toks=max_gen_toks,
        )
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        click.echo(f"layerswap: error [invalid_request]: {field}: {first['msg']}", err=True)
        sys.exit(2)
    data = (data_dir or Path("eval-data")).absolute()
    bar = tqdm(total=0, unit="req", desc="evaluating", disable=quiet)

    def progress(done: int, total: int) -> None:
        if total != bar.total or done < bar.n:  # the next request type (log-likelihoods first)
            bar.reset(total=total)
        bar.update(done - bar.n)

    try:
        with engine_errors():
            check_tasks(list(spec.tasks), tasks_dir, data)
            outcome = run_evaluation(
                model_dir,
                spec,
                tasks_dir=tasks_dir,
                data_dir=data,
                device=device,
                on_progress=progress,
            )
    except ServiceError as e:
        click.echo(f"layerswap: error [{e.code}]: {e.message}", err=True)
        sys.exit(1)
    finally:
        bar.close()
    if samples is not None:
        write_samples(outcome.samples, samples)
    click.echo(results_table(outcome.scores))
    click.echo(f"lm-eval {outcome.lm_eval_version}; {outcome.seconds:.1f} s")


def results_table(scores: list[Any]) -> str:
    """Like lm-eval's own table, plus the standard error."""
    header = ("Task", "Filter", "n-shot", "Metric", "Value", "Stderr", "Docs")
    rows = [
        (
            s.task,
            s.filter,
            str(s.num_fewshot),
            s.metric,
            f"{s.value:.4f}",
            "N/A" if s.stderr is None else f"{s.stderr:.4f}",
            str(s.samples),
        )
        for s in scores
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |", line]
    out += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join(out)


@cli.command()
@click.option("--base", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option(
    "--expert",
    "experts",
    multiple=True,
    required=True,
    help="An expert directory, or LABEL=DIR; the label defaults to the directory name.",
)
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--task", help="Label (or directory) of the task expert, for a swap suggestion.")
@click.option("--language", help="Label (or directory) of the language expert.")
@click.option("--threshold", type=float, help="Row-MAV threshold (default: automatic).")
def analyze(
    base: Path,
    experts: tuple[str, ...],
    out_dir: Path,
    task: str | None,
    language: str | None,
    threshold: float | None,
) -> None:
    """Delta analysis of experts against their base: JSON matrix + heatmap PNG."""
    with engine_errors():
        from worker.engine.analysis import analyze as run_analysis

        labelled = [_labelled(spec) for spec in experts]
        by_path = {str(path): label for label, path in labelled}
        result = run_analysis(
            base=base,
            experts=labelled,
            threshold=threshold,
            task=by_path.get(task, task) if task else None,
            language=by_path.get(language, language) if language else None,
        )
        for path in result.write(out_dir):
            click.echo(f"wrote {path}")
        if result.suggestion is not None:
            s = result.suggestion
            click.echo(f"suggested (heuristic): bottom={s.bottom} top={s.top}")


def _labelled(spec: str) -> tuple[str, Path]:
    label, sep, path = spec.partition("=")
    if sep and label and "/" not in label:
        return label, Path(path)
    return Path(spec).name, Path(spec)


@cli.command()
@click.argument("out_dir", type=click.Path(path_type=Path, file_okay=False))
def examples(out_dir: Path) -> None:
    """Create tiny example checkpoints (base, math, swh) and one recipe per method."""
    from worker.examples import make_examples

    made = make_examples(out_dir)
    for name, path in made.items():
        click.echo(f"{name:>28}  {path}")
    click.echo(f"try: layerswap merge {out_dir}/layer_swap.yaml --out {out_dir}/merged")


@cli.command()
@click.option("--host", help="Bind address (default LAYERSWAP_HOST or 127.0.0.1).")
@click.option("--port", type=int, help="Port (default LAYERSWAP_PORT or 8000).")
@click.option(
    "--workers", type=click.IntRange(1, 64), default=1, show_default=True,
    help="API processes sharing the port (more than one needs PostgreSQL).",
)  # fmt: skip
def serve(host: str | None, port: int | None, workers: int) -> None:
    """Run the HTTP API; with no configuration, on the embedded default (SQLite, in-process)."""
    import os

    import uvicorn

    from service.app import create_app
    from service.db.migrate import upgrade

    settings = load_settings(host=host, port=port)
    check_merge_device(settings)  # the in-process executor merges here
    if workers > 1 and settings.database.startswith("sqlite"):
        click.echo(
            "layerswap: error [invalid_settings]: --workers > 1 needs PostgreSQL "
            "(LAYERSWAP_DATABASE_URL): SQLite has one writer at a time",
            err=True,
        )
        sys.exit(2)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    for root in settings.source_roots:
        root.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    check_webhook_keys(settings)
    click.echo(
        f"layerswap: serving on http://{settings.host}:{settings.port} "
        f"(database {settings.database.split('@')[-1]}, executor {settings.executor}, "
        f"{workers} process{'es' if workers > 1 else ''})"
    )
    if workers == 1:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                    log_level="info", log_config=serve_logging())  # fmt: skip
        return
    # Each process builds its own app from the environment: pass the overrides on.
    os.environ.update(LAYERSWAP_HOST=settings.host, LAYERSWAP_PORT=str(settings.port))
    uvicorn.run(
        "service.app:app_from_environment", factory=True, workers=workers,
        host=settings.host, port=settings.port, log_level="info", log_config=serve_logging(),
    )  # fmt: skip


def serve_logging() -> dict[str, Any]:
    """uvicorn's logging, with each request's access line written by a plain formatter (the
    same words, no colours): uvicorn's own copies every record to colour it, which cost a
    tenth of the CPU of a page of merges."""
    import uvicorn.config

    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["formatters"]["access"] = {"format": "%(levelname)s:     %(message)s"}
    return config


def check_webhook_keys(settings: Settings) -> None:
    """Keys that cannot decrypt the stored webhook secrets stop the start in one line, before
    the API is up (its start-up would say the same under a traceback)."""
    from service.db.session import Database
    from service.webhooks.encryption import SecretKeyError, box_for, prepare

    try:
        prepare(Database(settings.database), box_for(settings))
    except SecretKeyError as e:
        click.echo(f"layerswap: error [invalid_settings]: {e}", err=True)
        sys.exit(2)


@cli.command()
@click.option(
    "--queues",
    default="merge,eval",
    show_default=True,
    help="Comma-separated queues to take jobs from (merge, eval).",
)
@click.option("--hostname", help="Worker name shown in flower (default: celery@<host>).")
@click.option("--loglevel", default="INFO", show_default=True)
@click.option(
    "--nice", type=click.IntRange(0, 19), default=0, show_default=True,
    help="Lower this worker's CPU priority by this much (as nice(1) does). For a host the "
    "worker shares with the API: merges then take the CPU the API leaves, and requests are "
    "answered first. Pointless where workers have machines of their own.",
)  # fmt: skip
def worker(queues: str, hostname: str | None, loglevel: str, nice: int) -> None:
    """Run a Celery worker: one job at a time, in this process (no fork: CUDA does not survive
    one). Configuration comes from the same LAYERSWAP_* variables as `serve`."""
    import os

    from worker import watchdog
    from worker.celery_app import QUEUES, make_celery, register_task

    chosen = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = sorted(set(chosen) - set(QUEUES))
    if unknown or not chosen:
        click.echo(
            f"layerswap: error [invalid_queues]: {', '.join(unknown) or 'none given'}: "
            f"queues are {', '.join(QUEUES)}",
            err=True,
        )
        sys.exit(2)
    settings = load_settings()
    check_merge_device(settings)
    if nice:
        os.nice(nice)  # before any thread starts: every thread of the process has it
    app = make_celery(settings)
    register_task(app, settings)
    watchdog.install(app, settings.worker_watchdog_s)
    argv = [
        "worker",
        # solo: the task runs in the worker's own process, one at a time. The prefork pool would
        # fork children after import (CUDA cannot be used across fork) and run several merges
        # at once, each wanting the whole GPU. Scale out with more worker processes instead.
        "--pool=solo",
        "--concurrency=1",
        f"--queues={','.join(chosen)}",
        f"--loglevel={loglevel}",
        "--without-gossip",  # nothing here uses worker-to-worker chatter; it costs a connection
        "--without-mingle",
    ]
    if hostname:
        argv.append(f"--hostname={hostname}")
    app.worker_main(argv)


def check_merge_device(settings: Any) -> None:
    """LAYERSWAP_MERGE_DEVICE=cuda on a host without a GPU stops the process at start, not
    every job later."""
    from worker.engine.errors import DeviceError
    from worker.engine.merge import resolve_device

    try:
        resolve_device(settings.merge_device)
    except DeviceError as e:
        click.echo(f"layerswap: error [invalid_settings]: merge_device: {e.message}", err=True)
        sys.exit(2)


def load_settings(**overrides: Any) -> Any:
    from pydantic import ValidationError

    from service.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        problem = e.errors()[0]
        where = ".".join(str(p) for p in problem["loc"]) or "settings"
        message = str(problem["msg"]).removeprefix("Value error, ")
        click.echo(f"layerswap: error [invalid_settings]: {where}: {message}", err=True)
        sys.exit(2)


@cli.group()
def keys() -> None:
    """API keys."""


@keys.command("create")
@click.option("--tenant", required=True, help="The tenant the key acts for.")
def keys_create(tenant: str) -> None:
    """Create an API key and print it (only this once; only its hash is stored)."""
    from service.auth import create_key
    from service.db.migrate import upgrade
    from service.db.session import Database
    from service.errors import ServiceError

    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    try:
        click.echo(create_key(Database(settings.database), tenant))
    except ServiceError as e:
        click.echo(f"layerswap: error [{e.code}]: {e.message}", err=True)
        sys.exit(2)


@keys.command("list")
@click.option("--tenant", help="Only this tenant's keys.")
def keys_list(tenant: str | None) -> None:
    """List keys: id, tenant, created, revoked (never the secret)."""
    from service.auth import list_keys

    found = list_keys(_key_database(), tenant=tenant)
    click.echo(f"{'ID':<32}  {'TENANT':<20}  {'CREATED':<25}  REVOKED")
    for key in found:
        revoked = key.revoked_at.isoformat(timespec="seconds") if key.revoked_at else "-"
        created = key.created_at.isoformat(timespec="seconds")
        click.echo(f"{key.id:<32}  {key.tenant:<20}  {created:<25}  {revoked}")


@keys.command("revoke")
@click.argument("key_id")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by its id (from `keys list`) or by the key itself; every API process
    refuses it within a second (each remembers a key it looked up for at most that long)."""
    from service.auth import revoke_key
    from service.errors import ServiceError

    try:
        key, revoked_now = revoke_key(_key_database(), key_id)
    except ServiceError as e:
        click.echo(f"layerswap: error [{e.code}]: {e.message}", err=True)
        sys.exit(2)
    assert key.revoked_at is not None
    when = key.revoked_at.isoformat(timespec="seconds")
    state = "revoked" if revoked_now else "was already revoked"
    click.echo(f"key {key.id} of tenant {key.tenant} {state} ({when})")


def _key_database() -> Any:
    from service.db.migrate import upgrade
    from service.db.session import Database

    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    return Database(settings.database)


@cli.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Apply Alembic migrations up to the newest."""
    from service.db.migrate import upgrade

    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    click.echo("database schema is up to date")


add_remote_commands(cli)


def main() -> None:
    cli()
