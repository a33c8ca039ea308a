"""A layer-swap sweep evaluated in memory vs written then evaluated. Not part of the tests.

    .venv/bin/python bench/sweep.py [--reps 2] [--layers 8 --hidden 512] [--docs 16]

One expert pair (a synthetic float32 Llama base with a task and a language fine-tune), 8
configurations (bottom ∈ {1, 2, 3, 4} × top ∈ {1, 2}), the shipped `mgsm_local_direct_sw` task
on made-up rows. Each rep starts a fresh `layerswap serve` (embedded default, its own data
directory, so no evaluation is answered from an earlier rep) and runs the sweep twice:
`in_memory: true, keep: none` (nothing written) and `in_memory: false, keep: none` (each
configuration merged to disk by the streaming engine, evaluated, removed). Reports the wall
time from POST to `succeeded` and the bytes the server process wrote (/proc/<pid>/io
write_bytes). Writes bench/results/sweep.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.evaluation import ROOT, TASK, call, serving


def make_family(work: Path, args: argparse.Namespace) -> Path:
    import torch

    from worker.examples import make_checkpoint

    family = work / "checkpoints"
    if (family / "lang" / "config.json").is_file():
        return family
    size = {"layers": args.layers, "hidden": args.hidden, "intermediate": args.hidden * 11 // 4,
            "heads": 8, "kv_heads": 4, "dtype": torch.float32}  # fmt: skip
    base = make_checkpoint(family / "base", seed=0, **size)
    task = [0.01] * args.layers
    task[1:-1] = [0.06] * (args.layers - 2)
    lang = [0.01] * args.layers
    lang[0] = lang[-1] = 0.08
    make_checkpoint(family / "task", base=base, seed=1, layer_scale=task, dtype=torch.float32)
    make_checkpoint(family / "lang", base=base, seed=2, layer_scale=lang, dtype=torch.float32)
    return family


def make_data(work: Path, docs: int) -> Path:
    from worker.examples import make_eval_data

    return make_eval_data(work / "eval-data", questions=docs)


def written_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def run_sweep(
    family: Path, data: Path, args: argparse.Namespace, work: Path, in_memory: bool
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env.update(
        LAYERSWAP_EVAL_DATA_DIR=str(data), LAYERSWAP_ALLOWED_ROOTS=json.dumps([str(family)]),
        LAYERSWAP_RECONCILE_INTERVAL_S="0.5", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
    )  # fmt: skip
    with serving(work, env) as (base, pid):
        body = {
            "task_experts": [str(family / "task")], "language_experts": [str(family / "lang")],
            "base": str(family / "base"),
            "grid": {"bottom": [1, 2, 3, 4], "top": [1, 2]},
            "evaluation": {"tasks": [TASK], "num_fewshot": args.fewshot, "batch_size": 8,
                           "max_gen_toks": args.max_gen_toks, "dtype": "float32"},
            "objective": {"task": TASK, "metric": "exact_match"},
            "keep": "none", "in_memory": in_memory,
        }  # fmt: skip
        before = written_bytes(pid)
        started = time.perf_counter()
        sweep = call(f"{base}/v1/sweeps", body)
        while sweep["status"] not in ("succeeded", "failed", "canceled"):
            time.sleep(0.2)
            sweep = call(f"{base}/v1/sweeps/{sweep['id']}")
        seconds = time.perf_counter() - started
        if sweep["status"] != "succeeded":
            raise SystemExit(f"sweep ended {sweep['status']}: {sweep['result']}")
        wrote = written_bytes(pid) - before
        merged = sum(
            call(f"{base}/v1/merges/{t['merge_job_id']}")["progress"]["bytes_total"]
            for t in sweep["trials"]
            if t["merge_job_id"]
        )
        return {"seconds": seconds, "written_bytes": wrote, "merged_bytes": merged,
                "best": sweep["result"]["best"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--fewshot", type=int, default=2)
    parser.add_argument("--max-gen-toks", type=int, default=16)
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "data" / "sweep")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    family = make_family(args.work, args)
    data = make_data(args.work, args.docs)
    model_bytes = sum(f.stat().st_size for f in (family / "task").glob("*.safetensors"))
    runs: dict[str, list[dict[str, Any]]] = {"in memory": [], "written": []}
    for rep in range(args.reps):
        for name, in_memory in (("in memory", True), ("written", False)):
            runs[name].append(run_sweep(family, data, args, args.work, in_memory))
            print(f"rep {rep + 1} {name}: {runs[name][-1]}", flush=True)
    lines = [
        f"# Sweep of 8 layer-swap configurations on one pair ({args.layers}x{args.hidden} "
        f"float32 Llama, {model_bytes / 1e6:.0f} MB per model; {args.docs} documents, "
        f"{args.fewshot}-shot, {args.max_gen_toks} new tokens; {platform.machine()}, "
        f"{os.cpu_count()} cores)",
        "",
        "| mode | median s | MB written (server process) | MB merged | all reps (s) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, results in runs.items():
        seconds = [r["seconds"] for r in results]
        wrote = statistics.median(r["written_bytes"] for r in results) / 1e6
        merged = statistics.median(r["merged_bytes"] for r in results) / 1e6
        lines.append(f"| {name} | {statistics.median(seconds):.2f} | {wrote:.0f} | {merged:.0f} | "
                     + ", ".join(f"{s:.2f}" for s in seconds) + " |")  # fmt: skip
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "sweep.md").write_text("\n".join(lines) + "\n")
    record = {"args": {**vars(args), "work": str(args.work)}, "runs": runs}
    (results_dir / "sweep.json").write_text(json.dumps(record, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
