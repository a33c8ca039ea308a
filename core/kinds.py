"""Job kinds, each in one place: its URL collection, Celery queue, progress unit, the sources a
request reads and its webhook event.

The pipeline, the executors and the API look a kind up here instead of branching on its name;
a new kind is one more entry here and one runner in worker/pipeline.py. (A sweep is not a job:
it is made of merge and evaluation jobs, service/sweeps/.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.recipe import named_sources, parse_recipe


@dataclass(frozen=True)
class JobKind:
    name: str
    collection: str  # /v1/<collection>/{id}
    queue: Literal["merge", "eval"]  # Celery queue (eval: GPU workers)
    progress_unit: Literal["bytes", "requests"]  # what progress.done/total count
    sources: Callable[[dict[str, Any]], list[str]]  # the sources a request reads
    webhook_event: str  # the event type when a job ends, formatted with its {status}


# What a merge job's request holds beside its recipe (mergekit: the config it was translated
# from, engine.mergekit.MergekitOrigin.record).
MERGE_EXTRAS = ("evaluation", "sweep", "webhook", "mergekit")


def merge_recipe(request: dict[str, Any]) -> Any:
    """A merge job's recipe (its request, less the evaluation to run afterwards and the sweep
    trial it belongs to)."""
    return parse_recipe({k: v for k, v in request.items() if k not in MERGE_EXTRAS})


def _merge_sources(request: dict[str, Any]) -> list[str]:
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
            _merge_sources,
            "merge.{status}",
        ),
        JobKind(
            "analysis",
            "analyses",
            "merge",
            "bytes",
            _analysis_sources,
            "analysis.completed",
        ),
        JobKind(
            "evaluation",
            "evaluations",
            "eval",
            "requests",
            _evaluation_sources,
            "evaluation.completed",
        ),
    )
}
QUEUES = tuple(dict.fromkeys(kind.queue for kind in KINDS.values()))


def kind_of(name: str) -> JobKind:
    return KINDS[name]
