"""`layerswap evaluate`: lm-eval on a local checkpoint, through the service's own code path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError
from tqdm import tqdm

from core.errors import ServiceError
from core.evaluation.random_weights import RANDOM_WEIGHTS_NOTE, has_random_weights
from core.evaluation.results import write_samples
from core.evaluation.runner import Outcome
from core.evaluation.runner import evaluate as run_evaluation
from core.evaluation.spec import EvaluationSpec
from core.evaluation.tasks import check_tasks
from layerswap.cli.common import engine_errors, fail


@click.command()
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
        fail("invalid_request", f"{field}: {first['msg']}", 2)
    data = (data_dir or Path("eval-data")).absolute()
    outcome = _run(model_dir, spec, tasks_dir=tasks_dir, data=data, device=device, quiet=quiet)
    if samples is not None:
        write_samples(outcome.samples, samples)
    click.echo(results_table(outcome.scores))
    if has_random_weights(model_dir):
        click.echo(RANDOM_WEIGHTS_NOTE)
    click.echo(f"lm-eval {outcome.lm_eval_version}; {outcome.seconds:.1f} s")


def _run(
    model_dir: Path,
    spec: EvaluationSpec,
    *,
    tasks_dir: Path | None,
    data: Path,
    device: str,
    quiet: bool,
) -> Outcome:
    """The evaluation, with a progress bar; an expected failure exits with one line."""
    bar = tqdm(total=0, unit="req", desc="evaluating", disable=quiet)

    def progress(done: int, total: int) -> None:
        if total != bar.total or done < bar.n:  # the next request type (log-likelihoods first)
            bar.reset(total=total)
        bar.update(done - bar.n)

    try:
        with engine_errors():
            check_tasks(list(spec.tasks), tasks_dir)
            outcome = run_evaluation(
                model_dir,
                spec,
                tasks_dir=tasks_dir,
                data_dir=data,
                device=device,
                on_progress=progress,
            )
    except ServiceError as e:
        fail(e.code, e.message, 1)
    finally:
        bar.close()
    return outcome


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
