"""Bytes a layer swap fetches from the Hub: byte ranges of the tensors read vs whole shards.

Serves the benchmark's task and language experts (bench/data/<preset>, made by
make_checkpoints.py; sharded as save_pretrained shards them) from the suite's Hub-compatible
server (tests/hub/server.py, whose byte counter is the measure), and pins and fetches a layer
swap of them into an empty cache with the real huggingface_hub client, twice in one run:

- with this checkout's code (Range requests for the tensors a plan reads), and
- with a baseline commit's code (`--baseline`, default 3a40ab4: every shard holding a tensor
  read is downloaded whole), checked out into a temporary git worktree.

Each fetch runs in its own process (`--child`) with that code first on sys.path, so the
client's cache, its imports and its timings are its own. Also reported: the bytes of the
tensors the plan reads (the floor), and the same cache fetched a second time (bytes: 0).

    .venv/bin/python bench/hub_fetch.py --preset small      # writes bench/results/hub-<preset>.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
REPOS = {"task": "bench/math", "lang": "bench/swh"}
SWAP = {"small": (3, 1), "large": (5, 2), "tiny": (1, 1)}  # bottom, top (as bench/run.py)


def recipe(preset: str, shas: dict[str, str]) -> dict[str, Any]:
    bottom, top = SWAP[preset]
    return {
        "method": "layer_swap",
        "experts": {
            "task": [f"hf://{REPOS['task']}@{shas['task']}"],
            "language": [f"hf://{REPOS['lang']}@{shas['lang']}"],
        },
        "params": {"bottom": bottom, "top": top, "non_layer": "average"},
    }


def child(spec: dict[str, Any], cache: Path) -> None:
    """Fetch the recipe's inputs with whatever `worker` is first on sys.path; print figures."""
    from core.hub.fetch import fetch_inputs
    from engine.recipe import parse_recipe

    started = time.perf_counter()
    fetched = fetch_inputs(parse_recipe(spec), cache_dir=cache, token=None, local=Path)
    wall = time.perf_counter() - started
    fetched.close()
    print(json.dumps({"wall_s": round(wall, 2), "whole": sorted(fetched.downloaded)}))


def tensors_read(spec: dict[str, Any], models: dict[str, Path]) -> int:
    """Bytes of the input tensors the layer swap's plan reads, from the local copies."""
    from engine.planner import make_plan
    from engine.recipe import parse_recipe

    local = json.loads(json.dumps(spec))
    local["experts"] = {"task": [str(models["task"])], "language": [str(models["lang"])]}
    plan = make_plan(parse_recipe(local), resolve=Path)
    try:
        read = {
            (term.source, tensor.name): plan.checkpoints[term.source].tensors[tensor.name].nbytes
            for tensor in plan.tensors
            for term in tensor.terms
        }
        return sum(read.values())
    finally:
        plan.close()


def run_fetch(code: Path, spec: dict[str, Any], cache: Path, hub: Any) -> dict[str, Any]:
    before = sum(hub.bytes_served(repo, name) for repo, name in _files(hub))
    hub.clear_requests()
    env = {**os.environ, "PYTHONPATH": str(code), "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
    env.pop("HF_TOKEN", None)
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec), str(cache)],
        env=env, cwd=code, capture_output=True, text=True, check=True,
    )  # fmt: skip
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    figures["bytes"] = sum(hub.bytes_served(r, n) for r, n in _files(hub)) - before
    gets = [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    figures["requests"] = len(gets)
    figures["range_requests"] = sum(1 for r in gets if r.range)
    return figures


def _files(hub: Any) -> list[tuple[str, str]]:
    return [(repo, name) for repo in REPOS.values() for name in hub.entries(repo)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=sorted(SWAP))
    parser.add_argument("--baseline", default="3a40ab4", help="commit fetching whole shards")
    parser.add_argument(
        "--child", nargs=2, metavar=("RECIPE_JSON", "CACHE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child[0]), Path(args.child[1]))
        return

    sys.path.insert(0, str(ROOT))
    from tests.hub.server import FakeHub

    models = {k: BENCH / "data" / args.preset / k for k in ("task", "lang")}
    if not all((m / "config.json").is_file() for m in models.values()):
        sys.exit(
            f"no checkpoints: run .venv/bin/python bench/make_checkpoints.py --preset {args.preset}"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    hub = FakeHub().start()
    with tempfile.TemporaryDirectory(prefix="hub-bench-") as tmp:
        work = Path(tmp)
        baseline = work / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(baseline), args.baseline],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        try:
            shas = {}
            for key, repo in REPOS.items():
                hub.create_repo(repo)
                files = {p.name: p.read_bytes() for p in models[key].iterdir() if p.is_file()}
                shas[key] = str(hub.commit(repo, files, message=f"upload {key}"))
                del files
            spec = recipe(args.preset, shas)
            shards = {
                key: sum(p.stat().st_size for p in models[key].glob("*.safetensors"))
                for key in models
            }
            rows = {
                f"whole shards ({args.baseline})": run_fetch(baseline, spec, work / "c0", hub),
                f"byte ranges ({commit})": run_fetch(ROOT, spec, work / "c1", hub),
                f"byte ranges ({commit}), same cache again": run_fetch(
                    ROOT, spec, work / "c1", hub
                ),
            }
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False
            )
            hub.close()
    floor = tensors_read(spec, models)
    report(args, rows, floor, sum(shards.values()), commit)


def report(
    args: argparse.Namespace, rows: dict[str, dict[str, Any]], floor: int, total: int, commit: str
) -> None:
    mb = 1e6
    lines = [
        f"# Hub fetch of a layer swap: preset `{args.preset}`",
        "",
        f"Both experts: {total / mb:.0f} MB of safetensors; the tensors the plan reads: "
        f"{floor / mb:.1f} MB (bottom/top = {SWAP[args.preset]}, non-layer tensors averaged).",
        "",
        "| fetch | bytes from the Hub | / tensors read | GET requests (ranges) | wall s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['bytes'] / mb:.1f} MB | {r['bytes'] / floor:.3f} | "
            f"{r['requests']} ({r['range_requests']}) | {r['wall_s']} |"
        )
    lines += [
        "",
        f"Command: `.venv/bin/python bench/hub_fetch.py --preset {args.preset}` at {commit} "
        f"(the baseline's code from `git worktree` at {args.baseline}); bytes are the test Hub's "
        "byte counter (headers, configs and tokenizer files included); the Hub is local, so "
        "wall times show request overhead, not a network's bandwidth. "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    ]
    out = BENCH / "results" / f"hub-{args.preset}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
