"""Task names known without importing lm-eval are the names lm-eval's own index knows: read
from a task directory's YAML files (every shape of file lm-eval accepts or skips), and listed
for lm-eval's own tasks in core/evaluation/lm_eval_tasks.txt.gz."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

from core.evaluation.task_names import NAMES_FILE, listed_names, lm_eval_tasks_dir, names_in
from core.evaluation.tasks import SHIPPED_TASKS, our_names

# path -> content: tasks, tags, groups, includes, Python tasks, and the files lm-eval skips
TASK_FILES = {
    "a/plain.yaml": "task: t_plain\ntag: tag_one\n",
    "a/tags.yaml": "task: t_tags\ntag: [tag_one, tag_two]\n",
    "b/_template": "tag: tag_of_template\noutput_type: generate_until\n",
    "b/included.yaml": "include: _template\ntask: t_included\n",
    "b/named_template": "task: t_named_by_include\n",
    "b/inherits.yaml": "include: named_template\ndataset_path: x\n",
    "c/group.yaml": "group: g_one\ntask: [t_plain]\ntag: tag_of_group\n",
    "c/python.yaml": "class: !function module.Task\ntask: t_python\ntag: tag_python\n",
    "c/python_nameless.yaml": "class: !function module.Task\n",
    "c/function.yaml": "task: t_function\nprocess_docs: !function utils.process\n",
    "d/first.yaml": "task: t_twice\ntag: tag_first\n",
    "d/second.yaml": "task: t_twice\ntag: tag_second\n",
    "e/cycle_a.yaml": "include: cycle_b.yaml\ntask: t_cycle_a\n",
    "e/cycle_b.yaml": "include: cycle_a.yaml\ntask: t_cycle_b\n",
    "e/diamond.yaml": "include: [left, right]\ntask: t_diamond\n",
    "e/left": "include: base\n",
    "e/right": "include: base\n",
    "e/base": "output_type: generate_until\n",
    "f/list.yaml": "- t_list\n",
    "f/unknown_tag.yaml": "task: t_unknown_tag\nx: !unknown y\n",
    "f/no_task.yaml": "dataset_path: x\n",
    "f/list_name.yaml": "task: [t_x, t_y]\n",
    "f/number_tag.yaml": "task: t_number_tag\ntag: 5\n",
    "f/broken.yaml": "task: [unclosed\n",
    "__pycache__/hidden.yaml": "task: t_hidden\n",
    "g/other_suffix.yml": "task: t_yml\n",
}


def lm_eval_index(include: list[Path], defaults: bool = False) -> set[str]:
    # lm_eval: what the names must agree with (the eval extra, as these tests run)
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include] or None
    return set(TaskManager(include_path=paths, include_defaults=defaults).all_tasks)


def test_a_task_directory_has_the_names_lm_evals_index_gives_it(tmp_path: Path) -> None:
    for name, text in TASK_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    names = names_in(tmp_path)
    assert names == lm_eval_index([tmp_path])
    kept = {"t_included", "tag_of_template", "t_named_by_include", "t_python", "tag_python",
            "g_one", "tag_one", "tag_two", "t_function", "t_twice", "tag_first"}  # fmt: skip
    skipped = {"tag_of_group", "tag_second", "t_cycle_a", "t_diamond", "t_unknown_tag",
               "t_number_tag", "t_hidden", "t_yml", "t_x"}  # fmt: skip
    assert kept <= names and not skipped & names
    assert our_names(None) == lm_eval_index([SHIPPED_TASKS]) == names_in(SHIPPED_TASKS)
    assert {"mgsm_local_direct_sw", "mgsm_local_direct"} <= our_names(None)
    assert our_names(tmp_path) == names | our_names(None)


def test_the_listed_names_are_the_installed_lm_evals() -> None:
    """The list is lm-eval's own index of the installed release (made again for a new one), and
    its task files read as a task directory give the same names."""
    installed = version("lm_eval")
    listed = listed_names(NAMES_FILE, installed)
    assert listed is not None, f"{NAMES_FILE} lists another lm-eval than {installed}"
    assert listed == lm_eval_index([], defaults=True)
    assert "mgsm_direct_sw" in listed
    assert names_in(lm_eval_tasks_dir()) == listed
    assert listed_names(NAMES_FILE, "0.0.1") is None  # another release's list is not used
