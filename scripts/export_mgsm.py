"""Write MGSM as the local JSONL files the shipped `mgsm_local_direct_<lang>` tasks read.

Run where the Hugging Face Hub is reachable (the dataset is `juletxara/mgsm`, the one lm-eval's
own mgsm tasks use), then copy the output directory to the workers and point
LAYERSWAP_EVAL_DATA_DIR at it:

    .venv/bin/python scripts/export_mgsm.py --out eval-data            # every language
    .venv/bin/python scripts/export_mgsm.py --out eval-data --lang sw --lang te

Writes <out>/mgsm/<lang>/train.jsonl (the 8 exemplars used as few-shot examples) and
test.jsonl (250 questions), one row per line with question, answer, answer_number and
equation_solution, as in the dataset.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LANGUAGES = ("bn", "de", "en", "es", "fr", "ja", "ru", "sw", "te", "th", "zh")
FIELDS = ("question", "answer", "answer_number", "equation_solution")


def export(out: Path, language: str, dataset: str) -> dict[str, int]:
    import datasets

    loaded = datasets.load_dataset(dataset, language)
    counts = {}
    folder = out / "mgsm" / language
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = loaded[split]
        path = folder / f"{split}.jsonl"
        temporary = path.with_suffix(".jsonl.tmp")
        with temporary.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({k: row.get(k) for k in FIELDS}, ensure_ascii=False) + "\n")
        temporary.replace(path)
        counts[split] = len(rows)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the data directory to write")
    parser.add_argument("--lang", action="append", choices=LANGUAGES, help="default: all")
    parser.add_argument("--dataset", default="juletxara/mgsm")
    args = parser.parse_args()
    for language in args.lang or LANGUAGES:
        counts = export(args.out, language, args.dataset)
        print(f"mgsm/{language}: {counts['train']} train, {counts['test']} test")


if __name__ == "__main__":
    main()
