"""`custom_dataset` of the shipped tasks: MGSM rows from local JSONL files.

lm-eval calls it with the task's metadata and dataset_kwargs as keyword arguments; the data
directory arrives as the metadata `layerswap_data_dir` (core/evaluation/tasks.py sets it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def mgsm(*, language: str, layerswap_data_dir: str | None = None, **_: Any) -> Any:
    # datasets: heavy (the eval extra); loaded when local task data is read
    import datasets

    if not layerswap_data_dir:
        raise FileNotFoundError("no evaluation data directory (LAYERSWAP_EVAL_DATA_DIR)")
    folder = Path(layerswap_data_dir) / "mgsm" / language
    splits = {}
    for split in ("train", "test"):
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing (see scripts/export_mgsm.py)")
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        splits[split] = datasets.Dataset.from_list(
            [
                {
                    "question": str(r["question"]),
                    "answer": r.get("answer"),
                    "answer_number": r["answer_number"],
                    "equation_solution": r.get("equation_solution"),
                }
                for r in rows
            ]
        )
    return datasets.DatasetDict(splits)
