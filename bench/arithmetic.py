"""How much mergekit's narrow arithmetic moves a merge: per method, a bf16 (or fp16) mergekit
config merged as mergekit computes it (its `dtype`, Layerswap's default for a config) and with
`--arithmetic float32` (Layerswap's float32, rounded once), compared element by element.

    .venv/bin/python bench/arithmetic.py [--dtype bfloat16|float16] [--verify]

The checkpoints are `layerswap examples`' tiny Llama family (6 layers, hidden 64) in the chosen
dtype, under bench/data/arithmetic/<dtype>/: a base and three fine-tunes (math, swh, math2).
`--verify` also runs mergekit 0.1.5 (.venv-bench) on each config and checks that the default
output is its output, bit for bit (DARE and DELLA, whose drops are random, are left out of
that check). Prints a markdown table: the share of elements whose bits differ, the largest
absolute difference, and that difference over the largest |value| of its tensor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.merge import MergeOptions, merge
from engine.mergekit import translate
from tests.reference import load
from worker.examples import EXAMPLE_LAYERS, MATH_SCALE, SWH_SCALE, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
RANDOM = ("dare_ties", "della")


def checkpoints(root: Path, dtype: torch.dtype) -> dict[str, str]:
    paths = {"base": root / "base", "math": root / "math", "swh": root / "swh",
             "math2": root / "math2"}  # fmt: skip
    if not (root / "math2" / "config.json").is_file():
        make_checkpoint(paths["base"], layers=EXAMPLE_LAYERS, dtype=dtype, seed=0)
        for name, seed, scale in (("math", 1, MATH_SCALE), ("swh", 2, SWH_SCALE),
                                  ("math2", 3, MATH_SCALE)):  # fmt: skip
            make_checkpoint(paths[name], base=paths["base"], dtype=dtype, seed=seed,
                            layer_scale=scale, non_layer_scale=0.02)  # fmt: skip
    return {name: str(path) for name, path in paths.items()}


def configs(m: dict[str, str], dtype: str) -> dict[str, dict[str, Any]]:
    def weighted(*pairs: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"model": m[name], "parameters": p} for name, p in pairs]

    three = weighted(("math", {"weight": 0.5}), ("swh", {"weight": 0.3}),
                     ("math2", {"weight": 0.2}))  # fmt: skip
    dense = [{**e, "parameters": {**e["parameters"], "density": 0.5}} for e in three]
    made: dict[str, dict[str, Any]] = {
        "linear": {"models": three},
        "slerp": {"base_model": m["math"], "models": weighted(("math", {}), ("swh", {})),
                  "parameters": {"t": 0.4}},
        "task_arithmetic": {"base_model": m["base"], "models": three},
        "ties": {"base_model": m["base"], "models": dense, "parameters": {"normalize": True}},
        "dare_ties": {"base_model": m["base"], "models": dense},
        "breadcrumbs_ties": {"base_model": m["base"], "models": dense},
        "della": {"base_model": m["base"], "models": dense, "parameters": {"epsilon": 0.1}},
        "nuslerp": {"base_model": m["base"],
                    "models": weighted(("math", {"weight": 0.6}), ("swh", {"weight": 0.4}))},
        "model_stock": {"base_model": m["base"],
                        "models": weighted(("math", {}), ("swh", {}), ("math2", {}))},
    }  # fmt: skip
    return {name: {"merge_method": name, **c, "dtype": dtype} for name, c in made.items()}


def merged(config: dict[str, Any], out: Path, arithmetic: str | None) -> dict[str, torch.Tensor]:
    translated = translate(config, is_local=lambda ref: Path(ref).is_dir(), arithmetic=arithmetic)
    options = MergeOptions(durable=False, overwrite=True, mergekit=translated.origin)
    return load(merge(translated.recipe, out, resolve=Path, options=options).out_dir)


def compared(ours: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> tuple[float, ...]:
    differ = total = 0
    largest = relative = 0.0
    for name, a in ours.items():
        b = other[name]
        differ += int((a.view(torch.int16) != b.view(torch.int16)).sum())
        total += a.numel()
        gap = float((a.double() - b.double()).abs().max())
        largest = max(largest, gap)
        relative = max(relative, gap / max(float(a.double().abs().max()), 1e-30))
    return differ / total, largest, relative


def is_mergekits(config: dict[str, Any], ours: dict[str, torch.Tensor], work: Path) -> bool:
    path = work / f"{config['merge_method']}.yml"
    path.write_text(yaml.safe_dump(config))
    out = work / "mergekit"
    subprocess.run([str(ROOT / ".venv-bench/bin/mergekit-yaml"), str(path), str(out),
                    "--allow-crimes"], check=True, capture_output=True)  # fmt: skip
    theirs = load(out)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return all(torch.equal(t.view(torch.int16), theirs[n].view(torch.int16))
               for n, t in ours.items())  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--verify", action="store_true", help="check the default is mergekit's")
    args = parser.parse_args()
    work = ROOT / "bench" / "data" / "arithmetic" / args.dtype
    models = checkpoints(work, DTYPES[args.dtype])
    print(
        f"| method ({args.dtype} config) | elements differing | max abs difference | "
        f"over the tensor's max abs |" + (" default is mergekit's |" if args.verify else "")
    )
    print("|---|---:|---:|---:|" + ("---|" if args.verify else ""))
    for name, config in configs(models, args.dtype).items():
        narrow = merged(config, work / "out-narrow", None)
        wide = merged(config, work / "out-float32", "float32")
        share, largest, relative = compared(narrow, wide)
        row = f"| {name} | {share:.2%} | {largest:.3g} | {relative:.2%} |"
        if args.verify:
            row += " (random drops) |" if name in RANDOM else (
                f" {'yes' if is_mergekits(config, narrow, work) else 'NO'} |")  # fmt: skip
        print(row)


if __name__ == "__main__":
    main()
