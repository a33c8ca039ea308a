"""Which task names lm-eval accepts, known without importing it: importing lm-eval (pandas,
pyarrow, datasets) takes seconds and ~0.1 GB, and building its index of ~14,700 tasks as long
again, which a request must not wait on. Two sources, each read once per process:

- task directories (the shipped tasks/ and LAYERSWAP_EVAL_TASKS_DIR): their YAML files, read by
  the rules of lm-eval's own index (`lm_eval.tasks._index`): a task's name and tags, a group's
  name, includes merged, `!function` not imported; a file it would skip is skipped;
- lm-eval's own tasks: `lm_eval_tasks.txt.gz`, the names of its index, made once per lm-eval
  release (`python -m core.evaluation.task_names` writes it). With another lm-eval release
  installed, its task directory is read as ours are (seconds, once per process).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("layerswap.evaluation")

NAMES_FILE = Path(__file__).parent / "lm_eval_tasks.txt.gz"
HEADER = "lm-eval "  # the first line: the release whose names follow, one a line
_SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as lm-eval's index skips them

_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_Base):  # type: ignore[misc]
    """YAML as lm-eval's index reads it: a `!function` tag is its text, nothing is imported."""


_Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _config(path: Path, seen: set[Path]) -> dict[str, Any]:
    """A task file with its includes merged under it, as lm-eval's load_yaml: an included
    file's `task_list` is dropped, and a file reached twice (a cycle, or two includes of one
    file) is an error that skips the file."""
    path = path.expanduser().resolve()
    if path in seen:
        raise ValueError(f"{path}: included twice")
    seen.add(path)
    with path.open("rb") as f:
        config = yaml.load(f, Loader=_Loader)  # a safe loader, plus !function
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a mapping")
    if "include" not in config:
        return config
    includes = config.pop("include")
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes]:
        included = _config(path.parent / include, seen)  # an absolute include stays absolute
        included.pop("task_list", None)
        merged.update(included)
    return {**merged, **config}


def _entry(config: dict[str, Any]) -> tuple[Any, list[Any]]:
    """(name, tags it registers): a Python task (`class`) or a task registers its tags; a
    group only its name. KeyError where the file is none of them."""
    if "group" in config and "class" not in config:
        return config["group"], []
    name, tags = config["task"], config.get("tag")
    listed = [] if tags is None else [tags] if isinstance(tags, str) else list(tags)
    set(listed)  # TypeError, as in lm-eval, for a tag that cannot be a name
    return name, listed


@functools.cache
def names_in(directory: Path) -> frozenset[str]:
    """Every task, group and tag name the YAML files under `directory` define."""
    seen: set[Any] = set()
    files = (p for p in directory.glob("**/*.yaml") if not _SKIPPED_DIRS.intersection(p.parts))
    for path in sorted(files, key=lambda p: p.as_posix()):
        try:
            name, tags = _entry(_config(path, set()))
            if name in seen:  # defined before: this file counts for nothing, its tags neither
                continue
        except Exception:  # what lm-eval's index skips (unreadable, not a task, bad include)
            continue
        seen.add(name)
        seen.update(tags)
    return frozenset(n for n in seen if isinstance(n, str))


@functools.cache
def lm_eval_names() -> frozenset[str]:
    """The names of lm-eval's own tasks, groups and tags, of the installed release."""
    installed = version("lm_eval")
    listed = listed_names(NAMES_FILE, installed)
    if listed is not None:
        return listed
    log.warning(
        "%s does not list the tasks of the installed lm-eval %s: reading its task files instead "
        "(`python -m core.evaluation.task_names` lists them)", NAMES_FILE.name, installed,
    )  # fmt: skip
    return names_in(lm_eval_tasks_dir())


@functools.cache
def shipped_names() -> frozenset[str]:
    """The names `lm_eval_tasks.txt.gz` lists: those of the release the `eval` extra pins, what
    the workers run where this process has no lm-eval (an API whose workers evaluate)."""
    return frozenset(gzip.decompress(NAMES_FILE.read_bytes()).decode().splitlines()[1:])


def listed_names(path: Path, release: str) -> frozenset[str] | None:
    """The names `path` lists, if it lists those of lm-eval `release`; else None."""
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    if not lines or lines[0] != HEADER + release:
        return None
    return frozenset(lines[1:])


def lm_eval_tasks_dir() -> Path:
    """lm-eval's task directory, found without importing lm-eval."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("lm_eval")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def write_names_file(path: Path = NAMES_FILE) -> int:
    """List the installed lm-eval's task names, as its own index has them, into `path`.
    Returns how many."""
    # lm_eval: the eval extra, imported only to list its names (for a new lm-eval release)
    from lm_eval.tasks import TaskManager

    names = TaskManager().all_tasks
    text = "\n".join([HEADER + version("lm_eval"), *names]) + "\n"
    path.write_bytes(gzip.compress(text.encode(), mtime=0))  # the same bytes for the same list
    return len(names)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    log.info("%s: %d names", NAMES_FILE, write_names_file())
