"""`layerswap analyze` (delta analysis of experts against their base) and `layerswap examples`
(tiny checkpoints to try everything on)."""

from __future__ import annotations

from pathlib import Path

import click

from engine.analysis.files import write_analysis
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


@click.command()
@click.argument("out_dir", type=click.Path(path_type=Path, file_okay=False))
def examples(out_dir: Path) -> None:
    """Create tiny example checkpoints (base, math, swh) and one recipe per method."""
    from worker.examples import make_examples  # imports torch: only when making examples

    made = make_examples(out_dir)
    for name, path in made.items():
        click.echo(f"{name:>28}  {path}")
    click.echo(f"try: layerswap merge {out_dir}/layer_swap.yaml --out {out_dir}/merged")
