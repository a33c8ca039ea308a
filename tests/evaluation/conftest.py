"""A tiny real model, MGSM-format data built from what that model answers (so the expected
accuracy is known exactly), and an independent reference: greedy generations computed with
transformers directly, scored as the task says."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import built_once

LANG = "sw"
TASK = f"mgsm_local_direct_{LANG}"
UNTIL = ("Swali:", "\n\n", "\n")
MAX_GEN_TOKS = 6


def questions(count: int) -> list[str]:
    return [f"Mkulima ana ng'ombe {i} na kondoo {i + 3}; jumla ni wangapi?" for i in range(count)]


QUESTIONS = questions(8)


@dataclass(frozen=True)
class Model:
    path: Path
    data_dir: Path  # holds mgsm/sw/{train,test}.jsonl
    answers: list[str]  # the model's own greedy answer to each test question (0-shot)
    right: list[bool]  # which test rows' targets are the model's answer


def normalise(text: str) -> str:
    """exact_match with ignore_case and ignore_punctuation."""
    return text.lower().translate(str.maketrans("", "", string.punctuation))


def reference_answer(model_dir: Path, prompt: str, max_new_tokens: int = MAX_GEN_TOKS) -> str:
    """Greedy generation with transformers, cut at the task's stop strings, leading
    whitespace removed (the task's remove_whitespace filter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    encoded = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **encoded, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    text = tokenizer.decode(out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    for stop in UNTIL:
        text = text.split(stop)[0]
    return text.lstrip()


def write_mgsm(data_dir: Path, answers: list[str], right: list[bool]) -> None:
    folder = data_dir / "mgsm" / LANG
    folder.mkdir(parents=True, exist_ok=True)
    train = [
        {"question": f"Question: {i} + {i}?", "answer": f"Step-by-Step Answer: {2 * i}",
         "answer_number": 2 * i}
        for i in range(4)
    ]  # fmt: skip
    test = [
        {"question": q, "answer": None, "answer_number": a if ok else "424242"}
        for q, a, ok in zip(questions(len(answers)), answers, right, strict=True)
    ]
    for name, rows in (("train", train), ("test", test)):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
        )


def with_data(path: Path, data_dir: Path, count: int = len(QUESTIONS)) -> Model:
    """`path`'s own answers, and MGSM data under `data_dir` (`count` test questions) whose
    even rows expect them."""
    answers = [reference_answer(path, f"Swali: {q}\nAnswer:") for q in questions(count)]
    right = [i % 2 == 0 for i in range(count)]
    assert all(normalise(a) != "424242" for a in answers)
    write_mgsm(data_dir, answers, right)
    return Model(path, data_dir, answers, right)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("eval-model")
    path = make_checkpoint(root / "model", dtype=torch.float32, seed=7, layers=2)
    return with_data(path, root / "eval-data")


@pytest.fixture(scope="session")
def math_expert(examples: Path, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """The examples' math expert (the task expert of the API tests' merges), with data that
    it answers half right; made once per run (pytest-xdist's workers share it)."""

    def build(root: Path) -> None:
        model = with_data(examples / "math", root / "data")
        (root / "answers.json").write_text(json.dumps([model.answers, model.right]))

    root = built_once(tmp_path_factory, "math-eval", build)
    answers, right = json.loads((root / "answers.json").read_text())
    return Model(examples / "math", root / "data", answers, right)


CHOICE_TASK = "tiny_choice"
CHOICES = ["moja", "mbili", "tatu", "nne"]
CHOICE_QUESTIONS = [f"Swali: {i} ni nini?\nJibu:" for i in range(8)]


@dataclass(frozen=True)
class ChoiceTask:
    """A multiple-choice (log-likelihood) task in a LAYERSWAP_EVAL_TASKS_DIR of its own."""

    tasks_dir: Path
    picks: list[int]  # the choice the reference finds most likely, per question
    right: list[bool]  # which rows' label is that choice


def reference_picks(model_dir: Path, contexts: list[str], choices: list[str]) -> list[int]:
    """argmax over choices of log P(" " + choice | context), computed with transformers the
    way a causal LM scores a continuation: the whole text encoded, the context's tokens cut
    off, each continuation token's log-probability summed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    picks = []
    for context in contexts:
        scores = []
        for choice in choices:
            whole = tokenizer(context + " " + choice)["input_ids"]
            n_context = len(tokenizer(context)["input_ids"])
            with torch.no_grad():
                logits = model(torch.tensor([whole[:-1]])).logits[0].double()
            logprobs = logits.log_softmax(-1)
            scores.append(
                sum(float(logprobs[i - 1, whole[i]]) for i in range(n_context, len(whole)))
            )
        ranked = sorted(scores, reverse=True)
        assert ranked[0] - ranked[1] > 1e-3, "no clear choice: change the questions"
        picks.append(scores.index(ranked[0]))
    return picks


def write_choice_task(tasks_dir: Path, picks: list[int]) -> list[bool]:
    """Rows whose label is the model's pick on even rows and another choice on odd ones, and
    the task YAML."""
    right = [i % 2 == 0 for i in range(len(picks))]
    rows = [
        {"question": q, "choices": CHOICES, "label": p if ok else (p + 1) % len(CHOICES)}
        for q, p, ok in zip(CHOICE_QUESTIONS, picks, right, strict=True)
    ]
    write_choice_yaml(tasks_dir, CHOICE_TASK, rows, {"acc": "mean"})
    return right


def write_choice_yaml(
    tasks_dir: Path, task: str, rows: list[dict[str, Any]], metrics: dict[str, str]
) -> None:
    """A multiple-choice task on `rows` (question, choices, label) scored by `metrics` (name ->
    aggregation): plain lm-eval, the json loader on a local file."""
    tasks_dir.mkdir(parents=True, exist_ok=True)
    data = tasks_dir / f"{task}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    metric_list = "".join(
        f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: true\n"
        for name, aggregation in metrics.items()
    )
    (tasks_dir / f"{task}.yaml").write_text(
        f"""task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
{metric_list}metadata:
  version: 1.0
""",
        encoding="utf-8",
    )


@pytest.fixture(scope="session")
def choice_task(tiny_model: Model, tmp_path_factory: pytest.TempPathFactory) -> ChoiceTask:
    tasks_dir = tmp_path_factory.mktemp("choice-tasks")
    picks = reference_picks(tiny_model.path, CHOICE_QUESTIONS, CHOICES)
    return ChoiceTask(tasks_dir, picks, write_choice_task(tasks_dir, picks))


# The service tests' database fixture: each API test runs on SQLite and on PostgreSQL.
from tests.service.conftest import database_url  # noqa: E402, F401
