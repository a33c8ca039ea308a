"""Job kinds, each in one place: its URL collection, Celery queue, progress unit and runner.

The pipeline, the executors and the API look a kind up here instead of branching on its name;
a new kind is one more entry. (A sweep is not a job: it is made of merge and evaluation jobs,
service/sweeps/.) Runners are named as "module:function" and imported
only by the process that runs jobs, so the API never imports torch or lm-eval through this.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class JobKind:
    name: str
    collection: str  # /v1/<collection>/{id}
    queue: Literal["merge", "eval"]  # Celery queue (eval: GPU workers)
    progress_unit: Literal["bytes", "requests"]  # what progress.done/total count
    runner: str  # "module:function(job, db, settings, lease)"
    sources: Callable[[dict[str, Any]], list[str]]  # the sources a request reads
    webhook_event: str  # the event type when a job ends, formatted with its {status}

    def run(self) -> Callable[..., Any]:
        module, function = self.runner.split(":")
        return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


# What a merge job's request holds beside its recipe.
MERGE_EXTRAS = ("evaluation", "sweep", "webhook")


def merge_recipe(request: dict[str, Any]) -> Any:
    """A merge job's recipe (its request, less the evaluation to run afterwards and the sweep
    trial it belongs to)."""
    from worker.engine.recipe import parse_recipe

    return parse_recipe({k: v for k, v in request.items() if k not in MERGE_EXTRAS})


def _merge_sources(request: dict[str, Any]) -> list[str]:
    from worker.engine.recipe import named_sources

    return [n.source for n in named_sources(merge_recipe(request))]


def _analysis_sources(request: dict[str, Any]) -> list[str]:
    return [request["base"], *(e["path"] for e in request["experts"])]


def _evaluation_sources(request: dict[str, Any]) -> list[str]:
    target = request["target"]
    if "layer_swap" in target:  # a layer swap assembled in memory reads its experts
        return _merge_sources(target["layer_swap"])
    return [target["source"]] if target.get("source") else []


KINDS = {
    kind.name: kind
    for kind in (
        JobKind(
            "merge",
            "merges",
            "merge",
            "bytes",
            "worker.pipeline:run_merge",
            _merge_sources,
            "merge.{status}",
        ),
        JobKind(
            "analysis",
            "analyses",
            "merge",
            "bytes",
            "worker.analysis_jobs:run_analysis_job",
            _analysis_sources,
            "analysis.completed",
        ),
        JobKind(
            "evaluation",
            "evaluations",
            "eval",
            "requests",
            "worker.evaluation_jobs:run_evaluation",
            _evaluation_sources,
            "evaluation.completed",
        ),
    )
}
QUEUES = tuple(dict.fromkeys(kind.queue for kind in KINDS.values()))


def kind_of(name: str) -> JobKind:
    return KINDS[name]
