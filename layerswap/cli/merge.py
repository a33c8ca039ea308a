"""`layerswap merge`: the engine alone, on local directories (and Hub sources, fetched first).
A mergekit config (one with `merge_method`) is translated into a Layerswap recipe first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import click
import yaml

from core.hub.refs import hub_sources
from engine.errors import RecipeError
from engine.merge import MergeOptions, MergeResult
from engine.merge import merge as run_merge
from engine.mergekit import MergekitOrigin, is_mergekit_config, translate
from engine.planner import make_plan, reject_unknown_source
from engine.recipe import HubDestination, Recipe, parse_recipe
from engine.schema.parts import Arithmetic
from engine.schema.user_yaml import load_yaml
from layerswap.cli.common import cache_dir, engine_errors, hub_token, progress_bar
from layerswap.cli.mergekit_flags import mergekit_options, take_mergekit_flags

if TYPE_CHECKING:
    from core.hub.fetch import FetchedInputs


def load_recipe_file(
    path: Path, arithmetic: str | None = None
) -> tuple[Recipe, MergekitOrigin | None]:
    """The recipe in `path`; a mergekit config translated, with what it carries beside.
    `arithmetic` replaces the recipe's (or the mergekit config's `dtype`)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RecipeError.for_field("recipe", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise RecipeError.for_field("recipe", f"{path} is not UTF-8 text ({e.reason})") from None
    data = load_yaml(text, "recipe", name=str(path))  # bounded: aliases, nesting, size
    if not is_mergekit_config(data):
        asked = {"arithmetic": arithmetic} if arithmetic else {}
        return parse_recipe({**data, **asked} if isinstance(data, dict) else data), None
    # mergekit: a model that is a directory is local, anything else a Hub repository. Local
    # paths are relative to the config file, as in every recipe.
    translated = translate(
        data, is_local=lambda ref: (path.parent / ref).is_dir(), arithmetic=arithmetic
    )
    return translated.recipe, translated.origin


def local_resolver(root: Path) -> Callable[[str], Path]:
    """Recipe sources are directories, relative to the recipe file."""

    def resolve(source: str) -> Path:
        reject_unknown_source(source)
        return (root / source).resolve()

    return resolve


@click.command()
@click.argument("recipe_file", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("out_path", required=False, type=click.Path(path_type=Path, file_okay=False))
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the per-layer plan (and a mergekit config's translated recipe); write nothing.",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--no-fsync", is_flag=True, help="Skip fsync before publishing (faster, less safe).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--arithmetic",
    type=click.Choice(get_args(Arithmetic)),
    help="The dtype to compute in, replacing the recipe's `arithmetic` (float32 unless it "
    "sets one) or a mergekit config's `dtype`: float32 computes a bf16 or fp16 config more "
    "precisely than mergekit, and not to its bytes.",
)
@mergekit_options
def merge(
    recipe_file: Path,
    out_path: Path | None,
    out_dir: Path | None,
    dry_run: bool,
    device: str,
    overwrite: bool,
    no_fsync: bool,
    quiet: bool,
    arithmetic: str | None,
    **mergekit_flags: object,
) -> None:
    """Merge the checkpoints named in RECIPE_FILE (YAML: a Layerswap recipe, or a mergekit
    config) into OUT_PATH (or --out), as `mergekit-yaml CONFIG OUT_PATH` does. mergekit-yaml's
    flags are accepted too: --cuda is --device cuda, the others either change nothing here
    (a note says why) or are refused with the reason (--allow-crimes, --trust-remote-code)."""
    cuda, notes = take_mergekit_flags(mergekit_flags)
    out_dir = _output_path(out_path, out_dir, dry_run=dry_run)
    device = "cuda" if cuda and device == "cpu" else device
    for note in notes:
        click.echo(note, err=True)
    with engine_errors():
        recipe, mergekit = _local_recipe(recipe_file, arithmetic)
        local = local_resolver(recipe_file.parent)
        recipe, fetched = _pin_and_fetch(recipe, local, headers_only=dry_run)
        try:
            resolve = fetched.resolver(local) if fetched else local
            if dry_run:
                _show_plan(recipe, resolve, mergekit)
                return
            options = MergeOptions(
                device=device,
                durable=not no_fsync,
                overwrite=overwrite,
                hash_cache=cache_dir() / "sha256",
                known_digests=fetched.digests if fetched else {},
                mergekit=mergekit,
            )
            with progress_bar(disabled=quiet) as on_progress:
                result = run_merge(
                    recipe, out_dir, resolve=resolve, options=options, on_progress=on_progress
                )
        finally:
            if fetched is not None:
                fetched.close()
        _report(result)
        if recipe.output.hub is not None:
            _publish(result, recipe.output.hub)


def _local_recipe(
    recipe_file: Path, arithmetic: str | None
) -> tuple[Recipe, MergekitOrigin | None]:
    recipe, mergekit = load_recipe_file(recipe_file, arithmetic)
    if recipe.output.mlflow is not None:
        raise click.UsageError(
            "output.mlflow registers a merge made by the service (POST /v1/merges); "
            "the local command does not"
        )
    return recipe, mergekit


def _show_plan(
    recipe: Recipe, resolve: Callable[[str], Path], mergekit: MergekitOrigin | None
) -> None:
    """The dry run: the plan's table (after a mergekit config's translated recipe)."""
    try:
        plan = make_plan(recipe, resolve=resolve)
    except RecipeError as e:  # named as the mergekit config names it, where it was one
        raise (mergekit.renamed(e) if mergekit else e) from None
    plan.close()
    if mergekit is not None:
        mergekit.apply(plan)
        click.echo(_translated(recipe))
    click.echo(plan.table())


def _output_path(positional: Path | None, option: Path | None, *, dry_run: bool) -> Path:
    """OUT_PATH or --out, exactly one (a dry run writes nothing and needs neither)."""
    if positional is not None and option is not None:
        raise click.UsageError("give the output directory once: OUT_PATH or --out, not both")
    chosen = positional or option
    if chosen is None and not dry_run:
        raise click.UsageError("missing the output directory: OUT_PATH (or --out)")
    return chosen or Path(".")


def _translated(recipe: Recipe) -> str:
    """The Layerswap recipe a mergekit config became, as YAML a user can keep and run."""
    shown = recipe.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    return "# the mergekit config as a Layerswap recipe\n" + yaml.safe_dump(shown, sort_keys=False)


def _pin_and_fetch(
    recipe: Recipe, local: Callable[[str], Path], *, headers_only: bool
) -> tuple[Recipe, FetchedInputs | None]:
    """The recipe with its Hub sources pinned (a branch moving mid-run changes nothing) and
    what was fetched of them; no Hub source: the recipe as it is, and None."""
    if not hub_sources(recipe):
        return recipe, None
    # The Hub client is loaded only here and in _publish: a local merge starts without it.
    from core.hub.fetch import fetch_inputs
    from core.hub.pin import pin_recipe

    recipe, pins = pin_recipe(recipe, hub_token(recipe.credential))
    for pinned in pins:
        click.echo(f"{pinned.repo}@{pinned.revision} -> commit {pinned.sha}", err=True)
    fetched = fetch_inputs(
        recipe,
        cache_dir=cache_dir() / "hub",
        token=hub_token(recipe.credential),
        local=local,
        headers_only=headers_only,
    )
    return recipe, fetched


def _report(result: MergeResult) -> None:
    for warning in result.manifest["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    size = sum((result.out_dir / name).stat().st_size for name in result.files)
    click.echo(
        f"merged into {result.out_dir} ({len(result.files)} files, {size / 1e9:.3f} GB) "
        f"in {result.seconds:.1f} s; plan {result.plan_digest[:12]}"
    )


def _publish(result: MergeResult, dest: HubDestination) -> None:
    # The Hub client: loaded only when a merge publishes
    from core.hub.publish import publish

    published = publish(
        result.out_dir,
        dest,
        token=hub_token(dest.credential),
        job_id=f"cli-{result.plan_digest[:12]}",
        digests=result.files,
    )
    click.echo(f"published to {published.url}")
