"""`layerswap analyze` (delta analysis of experts against their base) and `layerswap examples`
(checkpoints to try everything on: tiny, or of a given size)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from engine.analysis.files import write_analysis
from engine.schema.parts import parse_size
from layerswap.cli.common import engine_errors


@click.command()
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
        from engine.analysis.deltas import (
            analyze as run_analysis,  # imports torch: only when analysing
        )

        labelled = [_labelled(spec) for spec in experts]
        by_path = {str(path): label for label, path in labelled}
        result = run_analysis(
            base=base,
            experts=labelled,
            threshold=threshold,
            task=by_path.get(task, task) if task else None,
            language=by_path.get(language, language) if language else None,
        )
        for path in write_analysis(result, out_dir):
            click.echo(f"wrote {path}")
        if result.suggestion is not None:
            s = result.suggestion
            click.echo(f"suggested (heuristic): bottom={s.bottom} top={s.top}")


def _labelled(spec: str) -> tuple[str, Path]:
    label, sep, path = spec.partition("=")
    if sep and label and "/" not in label:
        return label, Path(path)
    return Path(spec).name, Path(spec)


class SizeParam(click.ParamType[int | None, str | int]):
    """`tiny` or `default` (None: the tiny examples), else a size such as 500MB or 1GB."""

    name = "size"

    def convert(
        self, value: str | int, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | None:
        if value in ("tiny", "default"):
            return None
        if isinstance(value, int):
            return value
        from worker.sized_examples import shape_for  # imports torch: only when making examples

        try:
            size = parse_size(value)
            shape_for(size)
        except ValueError as e:
            self.fail(f"{e}; give tiny, or a size such as 500MB, 1GB, 4GB", param, ctx)
        return size


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option(
    "--size",
    type=SizeParam(),
    help="tiny (the default: 6 layers, under 1 MB each), or about how large each checkpoint is "
    "(e.g. 500MB, 1GB, 4GB): more and wider layers, written one tensor at a time.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def examples(out_dir: Path, size: int | None, quiet: bool) -> None:
    """Create example checkpoints (base, math, swh) and one recipe per method."""
    # both import torch: only when making examples
    from worker.examples import make_examples
    from worker.sized_examples import make_sized_examples

    if size is None:
        made = make_examples(out_dir)
    else:
        with _bars(disabled=quiet) as progress:
            made = make_sized_examples(out_dir, size, on_progress=progress)
    for name, path in made.items():
        click.echo(f"{name:>28}  {path}")
    click.echo(f"try: layerswap merge {out_dir}/layer_swap.yaml --out {out_dir}/merged")


@contextmanager
def _bars(*, disabled: bool) -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar per checkpoint, in bytes written."""
    bars: dict[str, tqdm[Any]] = {}

    def update(name: str, written: int, total: int) -> None:
        if name not in bars:
            for bar in bars.values():
                bar.close()
            bars[name] = tqdm(total=total, unit="B", unit_scale=True, desc=name, disable=disabled)
        bars[name].update(written)

    try:
        yield update
    finally:
        for bar in bars.values():
            bar.close()
