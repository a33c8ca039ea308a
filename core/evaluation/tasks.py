"""Which task names exist: lm-eval's own, the shipped local MGSM tasks (tasks/), and those in
LAYERSWAP_EVAL_TASKS_DIR. Checking a name needs no lm-eval import (core/evaluation/task_names.py);
running tasks does, and building lm-eval's task index takes seconds, so the TaskManager that
runs them is built once per process and data directory."""

from __future__ import annotations

import functools
import importlib.util
from importlib.metadata import version
from pathlib import Path
from typing import Any

from core.evaluation.errors import EvaluationUnavailable, UnknownTask
from core.evaluation.task_names import lm_eval_names, names_in, shipped_names

SHIPPED_TASKS = Path(__file__).parent / "tasks"


def lm_eval_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def require_lm_eval() -> None:
    if not lm_eval_installed():
        raise EvaluationUnavailable(
            "evaluation needs lm-eval, which is not installed here: pip install 'layerswap[eval]'"
        )


def lm_eval_version() -> str:
    return version("lm_eval")


def _ours(tasks_dir: Path | None) -> list[str]:
    return [str(SHIPPED_TASKS)] + ([str(tasks_dir)] if tasks_dir else [])


@functools.cache
def local_manager(tasks_dir: Path | None, data_dir: Path) -> Any:
    """Only our tasks (the shipped ones and LAYERSWAP_EVAL_TASKS_DIR's): milliseconds to build.
    The data directory reaches our tasks' loader as metadata."""
    require_lm_eval()
    # lm_eval: the optional eval extra, loaded when tasks are checked or run
    from lm_eval.tasks import TaskManager

    meta = {"layerswap_data_dir": str(data_dir)}
    return TaskManager(include_path=_ours(tasks_dir), include_defaults=False, metadata=meta)


@functools.cache
def full_manager(tasks_dir: Path | None, data_dir: Path) -> Any:
    """lm-eval's own tasks as well (ours take precedence): seconds to build, so only when a
    task is not one of ours, and once per process."""
    require_lm_eval()
    # lm_eval: seconds to import; loaded only for its own tasks
    from lm_eval.tasks import TaskManager

    meta = {"layerswap_data_dir": str(data_dir)}
    return TaskManager(include_path=_ours(tasks_dir), metadata=meta)


def task_manager(names: list[str], tasks_dir: Path | None, data_dir: Path) -> Any:
    """The cheapest TaskManager that knows every name in `names` (check_tasks first)."""
    local = local_manager(tasks_dir, data_dir)
    if set(names) <= set(local.all_tasks):
        return local
    return full_manager(tasks_dir, data_dir)


def our_names(tasks_dir: Path | None) -> frozenset[str]:
    """The task, group and tag names of our task directories (read once per process)."""
    return frozenset().union(*(names_in(Path(d)) for d in _ours(tasks_dir)))


def check_tasks(names: list[str], tasks_dir: Path | None, *, field: str = "tasks") -> None:
    """UnknownTask, naming the field and the first unknown name, unless every name is a task
    (or a group or tag of tasks) lm-eval or our task directories define. Imports nothing of
    lm-eval: what a request may wait on is reading a few YAML files and a list of names.
    Without lm-eval here (an API whose workers evaluate), lm-eval's names are those of the
    release the `eval` extra pins."""
    ours = our_names(tasks_dir)
    theirs = lm_eval_names() if lm_eval_installed() else shipped_names()
    for i, name in enumerate(names):
        if name in ours or name in theirs:
            continue
        raise UnknownTask(
            f"{field}.{i}: unknown task {name!r} (lm-eval task names such as mgsm_direct_sw, "
            "the shipped mgsm_local_direct_<lang>, or a task in LAYERSWAP_EVAL_TASKS_DIR)",
            details={"field": f"{field}.{i}", "task": name},
        )
