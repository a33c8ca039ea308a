"""A sweep's leaderboard, like the paper's Table 1: per configuration the objective's mean, min
and max over expert pairs, a standard error and 95 % interval, the rank, and whether it can be
told apart from the best (an exact McNemar test on the per-document results of every pair,
pooled); per pair, each configuration beside both of its experts. Rendered as JSON, CSV,
Markdown and a PNG plot."""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from sqlalchemy import select

from core import jobs
from core.db.models import Job, Sweep
from core.db.session import Database
from core.evaluation.compare import paired
from core.evaluation.results import outcomes, read_samples
from core.evaluations import scores_of_job
from core.settings import Settings
from service.sweeps.spec import Pair, SweepCreate

FILTER_PREFERENCE = ("flexible-extract", "strict-match", "remove_whitespace", "none")

Score = dict[str, Any]  # as scores_of_job gives it: task, metric, filter, value, stderr, job_id…
Cells = dict[str, dict[int, Score]]  # configuration -> expert pair's index -> its score


def children(db: Database, sweep_id: str) -> list[Job]:
    with db.session() as session:
        found = list(
            session.scalars(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.created_at))
        )
        for job in found:
            session.expunge(job)
    return found


def objective_score(scores: list[dict[str, Any]], spec: SweepCreate) -> dict[str, Any] | None:
    """The objective's score among an evaluation's (the preferred filter when none is set)."""
    wanted = spec.objective
    candidates = [s for s in scores if s["task"] == wanted.task and s["metric"] == wanted.metric]
    if wanted.filter is not None:
        candidates = [s for s in candidates if s["filter"] == wanted.filter]
    ranked = sorted(
        candidates,
        key=lambda s: (
            FILTER_PREFERENCE.index(s["filter"]) if s["filter"] in FILTER_PREFERENCE else 99,
            s["filter"],
        ),
    )
    return ranked[0] if ranked else None


def leaderboard(db: Database, settings: Settings, sweep: Sweep) -> dict[str, Any]:
    spec = SweepCreate.model_validate(sweep.request)
    pairs = spec.expert_pairs()
    cells, experts = _objective_scores(db, spec, children(db, sweep.id))
    return {
        "sweep_id": sweep.id,
        "objective": _objective(spec, cells),
        "pairs": len(pairs),
        "rows": _ranked_rows(settings, sweep.tenant_id, cells, len(pairs)),
        "per_pair": [_pair_row(i, pair, cells, experts) for i, pair in enumerate(pairs)],
        "experts": {source: score["value"] for source, score in experts.items()},
    }


def _objective_scores(
    db: Database, spec: SweepCreate, found: list[Job]
) -> tuple[Cells, dict[str, Score]]:
    """The objective's score of each succeeded evaluation: a trial's by (config, pair), an
    expert's own by its source."""
    cells: Cells = defaultdict(dict)
    experts: dict[str, Score] = {}
    for job in found:
        if job.kind != "evaluation" or job.status != jobs.SUCCEEDED:
            continue
        trial = job.request.get("sweep") or {}
        score = objective_score(scores_of_job(db, job), spec)
        if score is None:
            continue
        if trial.get("pair") is None:
            experts[str(job.request["target"].get("source"))] = score
        else:
            cells[trial["config"]][int(trial["pair"])] = score
    return cells, experts


def _objective(spec: SweepCreate, cells: Cells) -> dict[str, Any]:
    return {
        "task": spec.objective.task,
        "metric": spec.objective.metric,
        # as asked, or the one chosen when none was (the same for every score of a task)
        "filter": spec.objective.filter
        or next((c["filter"] for by in cells.values() for c in by.values()), None),
    }


def _ranked_rows(settings: Settings, tenant: str, cells: Cells, pairs: int) -> list[dict[str, Any]]:
    """A row per configuration, best mean first, each with its rank and its test against the
    best (None for the best itself)."""
    rows = [_row(config, by_pair, pairs) for config, by_pair in cells.items()]
    rows.sort(key=lambda r: (-r["mean"], r["config"]))
    best = rows[0] if rows else None
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
        row["vs_best"] = (
            _versus(settings, tenant, cells[row["config"]], cells[best["config"]])
            if best is not None and row is not best
            else None
        )
    return rows


def _pair_row(i: int, pair: Pair, cells: Cells, experts: dict[str, Score]) -> dict[str, Any]:
    """Pair `i`: its experts' own scores, and each configuration's beside the better of them."""
    task_score = experts.get(pair.task)
    language_score = experts.get(pair.language)
    best_expert = max(
        (s["value"] for s in (task_score, language_score) if s is not None), default=None
    )
    return {
        "pair": i,
        "task_expert": pair.task,
        "language_expert": pair.language,
        "task_expert_score": task_score["value"] if task_score else None,
        "language_expert_score": language_score["value"] if language_score else None,
        "configs": {
            config: {
                "value": by_pair[i]["value"],
                "minus_best_expert": None
                if best_expert is None
                else by_pair[i]["value"] - best_expert,
            }
            for config, by_pair in cells.items()
            if i in by_pair
        },
    }


def _row(config: str, by_pair: dict[int, Score], pairs: int) -> dict[str, Any]:
    values = [by_pair[i]["value"] for i in sorted(by_pair)]
    mean = sum(values) / len(values)
    errors = [by_pair[i]["stderr"] for i in sorted(by_pair)]
    # The mean of independent per-pair estimates: its variance is the sum of theirs over n².
    stderr = (
        math.sqrt(sum(e * e for e in errors)) / len(errors)
        if all(e is not None for e in errors)
        else None
    )
    return {
        "config": config,
        "pairs_scored": len(values),
        "pairs": pairs,
        "mean": mean,
        "min": min(values),
        "max": max(values),
        "stderr": stderr,
        "ci95": [mean - 1.96 * stderr, mean + 1.96 * stderr] if stderr is not None else None,
        "values": {str(i): by_pair[i]["value"] for i in sorted(by_pair)},
    }


def _versus(
    settings: Settings,
    tenant: str,
    mine: dict[int, Score],
    best: dict[int, Score],
) -> dict[str, Any] | None:
    """McNemar over (pair, document): the pairs both configurations were scored on. None
    where a pair's records say no right/wrong by the objective's metric."""
    first: dict[Any, bool] = {}
    second: dict[Any, bool] = {}
    for pair in sorted(set(mine) & set(best)):
        ours = _outcomes(settings, tenant, mine[pair])
        theirs = _outcomes(settings, tenant, best[pair])
        if ours is None or theirs is None:
            return None
        first.update({(pair, d): ok for d, ok in ours.items()})
        second.update({(pair, d): ok for d, ok in theirs.items()})
    test = paired(first, second)
    if test is None:
        return None
    return {**test.to_dict(), "distinguishable": test.significant}


def _outcomes(settings: Settings, tenant: str, score: Score) -> dict[Any, bool] | None:
    """doc id -> right or wrong by the score's own metric, from the records of the job that
    measured `score` ({} without records, None where the metric is not 0/1 per document)."""
    path: Path = settings.evaluations_dir / tenant / score["job_id"] / "samples.jsonl"
    if not path.is_file():
        return {}
    return outcomes(
        read_samples(path), task=score["task"], filter=score["filter"], metric=score["metric"]
    )


# --- renderings ----------------------------------------------------------------------------

COLUMNS = ("rank", "config", "mean", "min", "max", "stderr", "ci95_low", "ci95_high",
           "pairs_scored", "p_vs_best", "distinguishable_from_best")  # fmt: skip


def flat_rows(board: dict[str, Any]) -> list[dict[str, Any]]:
    flat = []
    for row in board["rows"]:
        versus = row["vs_best"]
        flat.append(
            {
                "rank": row["rank"],
                "config": row["config"],
                "mean": row["mean"],
                "min": row["min"],
                "max": row["max"],
                "stderr": row["stderr"],
                "ci95_low": row["ci95"][0] if row["ci95"] else None,
                "ci95_high": row["ci95"][1] if row["ci95"] else None,
                "pairs_scored": row["pairs_scored"],
                "p_vs_best": versus["p_value"] if versus else None,
                "distinguishable_from_best": versus["distinguishable"] if versus else None,
            }
        )
    return flat


def to_csv(board: dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in flat_rows(board):
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return out.getvalue()


def to_markdown(board: dict[str, Any]) -> str:
    objective = board["objective"]
    lines = [
        f"Objective: {objective['task']} / {objective['metric']}"
        + (f" / {objective['filter']}" if objective["filter"] else "")
        + f", over {board['pairs']} expert pair(s)",
        "",
        "| rank | config | mean | min | max | stderr | 95% CI | p vs best | distinguishable |",
        "|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in flat_rows(board):
        ci = (
            f"[{row['ci95_low']:.4f}, {row['ci95_high']:.4f}]"
            if row["ci95_low"] is not None
            else ""
        )
        p = "" if row["p_vs_best"] is None else f"{row['p_vs_best']:.4g}"
        told = {None: "(best)", True: "yes", False: "no"}[row["distinguishable_from_best"]]
        stderr = "" if row["stderr"] is None else f"{row['stderr']:.4f}"
        lines.append(
            f"| {row['rank']} | {row['config']} | {row['mean']:.4f} | {row['min']:.4f} | "
            f"{row['max']:.4f} | {stderr} | {ci} | {p} | {told} |"
        )
    return "\n".join(lines + _experts_markdown(board)) + "\n"


def _experts_markdown(board: dict[str, Any]) -> list[str]:
    """The `experts` baseline: each expert's own score, the bar a merge has to clear."""
    if not board["experts"]:
        return []
    lines = ["", "Experts alone (the `experts` baseline):", "", "| expert | score |", "|---|---:|"]
    return lines + [f"| {source} | {value:.4f} |" for source, value in board["experts"].items()]


def to_png(board: dict[str, Any], pairs: list[Any]) -> bytes:
    """Score per configuration, one bar per language expert (mean over its pairs), error bars
    from the evaluations' stderr, the experts' own scores as dashed reference lines."""
    # matplotlib: heavy; loaded when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    # matplotlib's pyplot: once the Agg backend is chosen
    import matplotlib.pyplot as plt

    configs = [row["config"] for row in board["rows"]]
    languages = list(dict.fromkeys(p.language for p in pairs))
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 * len(configs) + 2), 4.5))
    width = 0.8 / max(1, len(languages))
    for j, language in enumerate(languages):
        indices = [i for i, p in enumerate(pairs) if p.language == language]
        means, errors = [], []
        for row in board["rows"]:
            values = [row["values"][str(i)] for i in indices if str(i) in row["values"]]
            means.append(sum(values) / len(values) if values else 0.0)
            errors.append(row["stderr"] or 0.0)
        positions = [k + (j - (len(languages) - 1) / 2) * width for k in range(len(configs))]
        axes.bar(positions, means, width, yerr=errors, capsize=3, label=Path(language).name)
    for source, value in board["experts"].items():
        axes.axhline(value, linestyle="--", linewidth=1, color="grey")
        axes.annotate(Path(source).name, (len(configs) - 0.5, value), fontsize=7, color="grey")
    axes.set_xticks(range(len(configs)), configs, rotation=30, ha="right", fontsize=8)
    objective = board["objective"]
    axes.set_ylabel(f"{objective['task']} {objective['metric']}")
    axes.legend(title="language expert", fontsize=8)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    return out.getvalue()
