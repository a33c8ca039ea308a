"""CUDA vs CPU: wall time of the engine's merge per method on bench/data/<preset> (made by
make_checkpoints.py), and whether the GPU's output matches the CPU's. Needs a GPU.

    python bench/cuda.py --preset large [--methods soup,ties] [--reps 2]

Writes bench/results/cuda-<preset>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.run import layerswap_recipes  # noqa: E402
from engine.merge import MergeOptions, merge  # noqa: E402
from engine.recipe import parse_recipe  # noqa: E402


def timed_merge(recipe: dict[str, Any], out: Path, device: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    merge(
        parse_recipe(recipe), out, resolve=Path, options=MergeOptions(device=device, durable=False)
    )
    return time.perf_counter() - start


def max_abs_difference(a: Path, b: Path) -> float:
    from safetensors import safe_open

    worst = 0.0
    for shard in sorted(a.glob("*.safetensors")):
        with safe_open(shard, "pt") as fa, safe_open(b / shard.name, "pt") as fb:
            for name in fa.keys():  # noqa: SIM118 (safe_open has no __iter__)
                diff = (fa.get_tensor(name).float() - fb.get_tensor(name).float()).abs().max()
                worst = max(worst, float(diff))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="large")
    parser.add_argument("--methods", default="layer_swap,soup,ties")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--work", type=Path, help="output scratch dir (default bench/data/...)")
    args = parser.parse_args()
    data = ROOT / "bench" / "data" / args.preset
    config = json.loads((data / "base" / "config.json").read_text())
    models = {name: data / name for name in ("base", "task", "lang")}
    recipes = layerswap_recipes(models, int(config["num_hidden_layers"]))
    work = args.work or data / "work-cuda"
    rows = []
    for method in args.methods.split(","):
        seconds: dict[str, float] = {}
        for device in ("cpu", "cuda"):
            times = [timed_merge(recipes[method], work / device, device) for _ in range(args.reps)]
            seconds[device] = min(times)
        rows.append({
            "method": method, "cpu_s": seconds["cpu"], "cuda_s": seconds["cuda"],
            "speedup": seconds["cpu"] / seconds["cuda"],
            "max_abs_difference": max_abs_difference(work / "cpu", work / "cuda"),
        })  # fmt: skip
    result = {
        "preset": args.preset, "reps": args.reps, "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cpus": __import__("os").cpu_count(),
        "python": platform.python_version(), "rows": rows,
    }  # fmt: skip
    out = ROOT / "bench" / "results" / f"cuda-{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{result['gpu']}, torch {result['torch']}, {result['cpus']} CPUs, best of {args.reps}")
    print("| method | CPU s | CUDA s | speedup | max abs diff |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['cpu_s']:.2f} | {r['cuda_s']:.2f} | {r['speedup']:.2f}x "
              f"| {r['max_abs_difference']:.3g} |")  # fmt: skip


if __name__ == "__main__":
    main()
