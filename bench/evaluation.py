"""Service overhead of an evaluation: lm-eval's own command line vs `layerswap evaluate` vs a job
through the API, on the same model, task and settings. Not part of the test suite.

    .venv/bin/python bench/evaluation.py [--docs 64] [--reps 3] [--layers 8 --hidden 512]

The model is a synthetic Llama (worker.examples, float32) and the task the shipped
`mgsm_local_direct_sw` on made-up rows (8 exemplars, `--docs` questions), 8-shot, greedy,
`--max-gen-toks` new tokens. Each rep runs the three in turn:

- `lm-eval run --model hf ... --include_path core/evaluation/tasks` (a process of its own,
  imports included);
- `layerswap evaluate` (likewise a process of its own);
- a job: `POST /v1/evaluations` to a `layerswap serve` already up (embedded default, a fresh
  data directory per rep so nothing is answered from stored scores), timed from the POST to
  `succeeded` as a client polling every 0.2 s sees it.

Writes bench/results/evaluation.{md,json}; the ratios are medians over reps divided by
lm-eval's median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TASK = "mgsm_local_direct_sw"
TASKS_DIR = ROOT / "worker" / "evaluation" / "tasks"


def make_inputs(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    import torch

    from worker.examples import make_checkpoint, make_eval_data

    model = work / "model"
    if not (model / "config.json").is_file():
        make_checkpoint(
            model, layers=args.layers, hidden=args.hidden, intermediate=args.hidden * 11 // 4,
            heads=8, kv_heads=4, dtype=torch.float32, seed=3,
        )  # fmt: skip
    data = make_eval_data(work / "eval-data", questions=args.docs)
    return model, data


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed:\n{done.stderr[-3000:]}")
    return seconds


def lm_eval_cli(model: Path, data: Path, args: argparse.Namespace, env: dict[str, str]) -> float:
    return timed(
        [str(BIN / "lm-eval"), "run", "--model", "hf",
         "--model_args", f"pretrained={model},dtype=float32", "--tasks", TASK,
         "--include_path", str(TASKS_DIR),
         "--metadata", json.dumps({"layerswap_data_dir": str(data)}),
         "--num_fewshot", "8", "--batch_size", str(args.batch_size), "--device", "cpu",
         "--gen_kwargs", f"max_gen_toks={args.max_gen_toks}", "--seed", "1234"],
        env,
    )  # fmt: skip


def layerswap_cli(model: Path, data: Path, args: argparse.Namespace, env: dict[str, str]) -> float:
    return timed(
        [str(BIN / "layerswap"), "evaluate", str(model), "--tasks", TASK, "--num-fewshot", "8",
         "--batch-size", str(args.batch_size), "--max-gen-toks", str(args.max_gen_toks),
         "--data-dir", str(data), "-q"],
        env,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def call(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


@contextmanager
def serving(work: Path, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """A `layerswap serve` on a fresh data directory (nothing reused from an earlier run):
    its base URL and process id, once it answers."""
    port = free_port()
    data_dir = work / "service"
    shutil.rmtree(data_dir, ignore_errors=True)
    server_env = {**env, "LAYERSWAP_DATA_DIR": str(data_dir), "LAYERSWAP_PORT": str(port)}
    log = (work / "serve.log").open("w")
    server = subprocess.Popen([str(BIN / "layerswap"), "serve"], env=server_env, stdout=log,
                              stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                call(f"{base}/healthz")
                break
            except OSError as e:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(
                        f"layerswap serve did not start: see {work / 'serve.log'}"
                    ) from e
                time.sleep(0.2)
        yield base, server.pid
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def api_job(
    model: Path, data: Path, args: argparse.Namespace, env: dict[str, str], work: Path
) -> float:
    server_env = {
        **env,
        "LAYERSWAP_EVAL_DATA_DIR": str(data),
        "LAYERSWAP_ALLOWED_ROOTS": json.dumps([str(model.parent)]),
    }
    with serving(work, server_env) as (base, _):
        evaluation = {"tasks": [TASK], "num_fewshot": 8, "batch_size": args.batch_size,
                      "max_gen_toks": args.max_gen_toks, "dtype": "float32"}  # fmt: skip
        started = time.perf_counter()
        job = call(f"{base}/v1/evaluations", {"source": str(model), "evaluation": evaluation})
        while job["status"] not in ("succeeded", "failed", "canceled"):
            time.sleep(0.2)
            job = call(f"{base}/v1/evaluations/{job['id']}")
        seconds = time.perf_counter() - started
        if job["status"] != "succeeded":
            raise SystemExit(f"the evaluation job ended {job['status']}: {job['error']}")
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-gen-toks", type=int, default=32)
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "data" / "evaluation")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model, data = make_inputs(args.work, args)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    runs: dict[str, list[float]] = {"lm-eval run": [], "layerswap evaluate": [], "API job": []}
    for rep in range(args.reps):
        runs["lm-eval run"].append(lm_eval_cli(model, data, args, env))
        runs["layerswap evaluate"].append(layerswap_cli(model, data, args, env))
        runs["API job"].append(api_job(model, data, args, env, args.work))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in runs.items()))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    reference = medians["lm-eval run"]
    lines = [
        f"# Evaluation overhead ({args.docs} documents, 8-shot, {args.max_gen_toks} new tokens, "
        f"batch {args.batch_size}; {args.layers}x{args.hidden} float32 Llama; "
        f"{platform.machine()}, {os.cpu_count()} cores)",
        "",
        "| run | median s | ratio to lm-eval | all reps (s) |",
        "|---|---:|---:|---|",
        *(
            f"| {k} | {medians[k]:.2f} | {medians[k] / reference:.3f} | "
            + ", ".join(f"{x:.2f}" for x in v)
            + " |"
            for k, v in runs.items()
        ),
    ]
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "evaluation.md").write_text("\n".join(lines) + "\n")
    record = {"args": {**vars(args), "work": str(args.work)}, "runs": runs, "medians": medians}
    (results / "evaluation.json").write_text(json.dumps(record, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
