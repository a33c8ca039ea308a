"""lm-eval's output as what the service stores: one score per task × filter × metric, and one
per-sample record (prompt, response, extracted answer, target, metrics, correct) per document ×
filter. `metrics` holds every metric's value for the document; a paired test of a score reads
that score's own metric there (`outcomes`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Score:
    task: str
    filter: str
    metric: str
    value: float
    stderr: float | None
    num_fewshot: int | None
    samples: int  # documents scored
    task_version: str
    config_hash: str  # sha256 of the task's resolved lm-eval config

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def scores_of(results: dict[str, Any]) -> list[Score]:
    found = []
    for task, values in results["results"].items():
        config = results.get("configs", {}).get(task, {})
        config_hash = hashlib.sha256(
            json.dumps(config, sort_keys=True, default=str).encode()
        ).hexdigest()
        n_samples = results.get("n-samples", {}).get(task, {})
        for key, value in values.items():
            if "," not in key or "_stderr," in key or not isinstance(value, int | float):
                continue
            metric, filter_ = key.split(",", 1)
            stderr = values.get(f"{metric}_stderr,{filter_}")
            found.append(
                Score(
                    task=task,
                    filter=filter_,
                    metric=metric,
                    value=float(value),
                    stderr=float(stderr)
                    if isinstance(stderr, int | float) and math.isfinite(stderr)
                    else None,
                    num_fewshot=results.get("n-shot", {}).get(task),
                    samples=int(n_samples.get("effective", 0)),
                    task_version=str(results.get("versions", {}).get(task, "")),
                    config_hash=config_hash,
                )
            )
    return found


def sample_records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per document and filter: what the model was asked, said, and how it was scored:
    `metrics` maps each of the task's metrics to its value for the document. `correct` is the
    first 0/1 one (None without one): a quick look at a record, and what clients read before
    `metrics`; with several metrics (acc and acc_norm) it speaks for the first only."""
    records = []
    for task, samples in (results.get("samples") or {}).items():
        for sample in samples:
            arguments = sample.get("arguments") or []
            first = arguments[0] if arguments else []
            prompt = first[0] if isinstance(first, list | tuple) and first else first
            metrics = {m: _number(sample.get(m)) for m in sample.get("metrics", [])}
            binary = [v for v in metrics.values() if _binary(v)]
            records.append(
                {
                    "task": task,
                    "filter": sample.get("filter"),
                    "doc_id": sample.get("doc_id"),
                    "prompt": prompt,
                    "response": _first(sample.get("resps")),
                    "extracted": _first(sample.get("filtered_resps")),
                    "target": sample.get("target"),
                    "metrics": metrics,
                    "correct": bool(binary[0]) if binary else None,
                }
            )
    return records


def _number(value: Any) -> Any:
    """numpy scalars as plain numbers (they are not JSON)."""
    return value.item() if hasattr(value, "item") else value


def _first(value: Any) -> Any:
    """A generation as its text; a multiple-choice answer as one log-likelihood per choice."""
    if isinstance(value, tuple) and value:
        return _first(value[0])  # (loglikelihood, is_greedy)
    if isinstance(value, list):
        if len(value) == 1:
            return _first(value[0])
        return [_first(v) for v in value]
    value = _number(value)
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)


def write_samples(records: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)


def read_samples(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def outcomes(
    records: list[dict[str, Any]], *, task: str, filter: str, metric: str
) -> dict[Any, bool] | None:
    """doc id -> right or wrong by `metric`, from the records of `task` × `filter`. None where
    that is not a right/wrong per document: a metric that is not 0/1 per document (a paired
    right/wrong test would be wrong), or records that do not keep it (records without
    `metrics` say `correct` only, of a metric they do not name). No records: empty."""
    found: dict[Any, bool] = {}
    for record in records:
        if record.get("task") != task or record.get("filter") != filter:
            continue
        value = (record.get("metrics") or {}).get(metric)
        if not _binary(value):
            return None
        found[record["doc_id"]] = bool(value)
    return found


def _binary(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, int | float) and value in (0, 1))
