"""Times `layerswap merge` against `mergekit-yaml` on the mergekit configs in bench/configs/,
one run each, and compares the two outputs tensor by tensor.

    .venv/bin/python bench/make_checkpoints.py --preset large   # bench/data/large/{base,task,lang}
    .venv/bin/python bench/make_lora.py                         # bench/data/large/lora
    .venv/bin/python bench/mergekit_methods.py [NAME ...] [--mergekit-timeout S] [--no-fsync]

NAME is a config's file name without `.yml` (default: all of them). Each tool runs from
bench/configs/ (the configs' model paths are relative to it, which both tools accept) under
`/usr/bin/time -v`, after its inputs were read through once (warm page cache, as run.py's
figures); mergekit under `timeout` (a run cut short is reported as "> S s"), with
`--lora-merge-cache` where a config has a `model+lora` reference (it refuses one without).
Layerswap runs with `-q`, a sha256 cache of the inputs filled beforehand, and its modules
compiled to bytecode first (pip compiled mergekit's at install); with `--no-fsync`, it runs
with `--no-fsync` too: mergekit-yaml leaves its output in the page cache, where Layerswap by
default waits until its output is on the disk. Each result is appended to
bench/results/mergekit-methods.jsonl as one JSON line; the outputs are deleted once compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as bench/arithmetic.py does
from bench.run import (
    LAYERSWAP,
    MERGEKIT,
    RESULTS_DIR,
    ROOT,
    TIME,
    Tensors,
    compare_outputs,
    describe_comparison,
    loadavg,
    parse_time_v,
    read_into_page_cache,
    remove,
)

CONFIGS = Path(__file__).resolve().parent / "configs"
WORK = Path(__file__).resolve().parent / "data" / "large" / "work" / "methods"


def inputs(config: Path) -> tuple[Path, ...]:
    """The directories a config reads (a `model+lora` reference names two)."""
    found: list[Path] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            for part in node.split("+"):
                if (CONFIGS / part).is_dir() and (CONFIGS / part).resolve() not in found:
                    found.append((CONFIGS / part).resolve())

    walk(yaml.safe_load(config.read_text()))
    return tuple(found)


def timed(argv: list[str], name: str, env: dict[str, str], timeout: int | None) -> dict[str, Any]:
    """One run under /usr/bin/time -v (and `timeout`): wall s, peak RSS MB, exit status."""
    timing, log = WORK / f"{name}.time", WORK / f"{name}.log"
    limit = ["timeout", str(timeout)] if timeout else []
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(TIME), "-v", "-o", str(timing), *limit, *argv],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=CONFIGS, check=False,
        )  # fmt: skip
    measured = parse_time_v(timing.read_text())
    return {
        "wall_s": measured.wall_s, "peak_rss_mb": measured.max_rss_kb / 1024,
        "cpu_s": measured.cpu_s, "exit": proc.returncode,
        "timed_out": proc.returncode == 124, "log_tail": log.read_text(errors="replace")[-600:],
    }  # fmt: skip


def cast_comparison(ours: Path, theirs: Path) -> dict[str, Any]:
    """Where mergekit wrote another dtype: its values exact in Layerswap's dtype, and equal
    once rounded to it, tensor by tensor."""
    import torch  # torch: as bench/run.py's comparison

    a, b = Tensors(ours), Tensors(theirs)
    names = sorted(set(a.names()) & set(b.names()))
    exact = equal = 0
    for name in names:
        x, y = a.get(name), b.get(name)
        exact += bool(torch.equal(y.to(x.dtype).to(y.dtype), y))
        equal += bool(torch.equal(y.to(x.dtype), x))
    text = (
        f"mergekit's values exact in Layerswap's dtype in {exact}/{len(names)} tensors, "
        f"equal once rounded to it in {equal}/{len(names)}"
    )
    return {"tensors": len(names), "exact_in_dtype": exact, "equal_rounded": equal, "text": text}


def run_one(name: str, timeout: int, source: str | None, no_fsync: bool) -> dict[str, Any]:
    """Both tools on one config, then the comparison; the outputs removed. `source`: a
    directory Layerswap's packages are imported from instead of this checkout; `no_fsync`:
    Layerswap with --no-fsync, leaving its output in the page cache as mergekit-yaml does."""
    config = CONFIGS / f"{name}.yml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    envs = {
        "mergekit": env,
        "layerswap": {**env, "LAYERSWAP_CACHE_DIR": str(WORK.parent / "cache")},
    }
    if source:
        envs["layerswap"]["PYTHONPATH"] = source
    outs = {tool: WORK / f"{name}-{tool}" for tool in ("layerswap", "mergekit")}
    argvs = {
        "layerswap": [str(LAYERSWAP), "merge", config.name, str(outs["layerswap"]), "-q"]
        + ["--no-fsync"] * no_fsync,
        "mergekit": [str(MERGEKIT), config.name, str(outs["mergekit"])],
    }
    if "+" in config.read_text():  # mergekit merges a LoRA into a copy first, written there
        argvs["mergekit"] += ["--lora-merge-cache", str(WORK / "lora-merge-cache")]
    result: dict[str, Any] = {"config": name, "load_before": loadavg()}
    for tool in ("layerswap", "mergekit"):
        remove(outs[tool])
        subprocess.run(["sync"], check=True)
        read_into_page_cache(inputs(config))
        limit = timeout if tool == "mergekit" else None
        result[tool] = timed(argvs[tool], f"{name}-{tool}", envs[tool], limit)
        result[tool]["command"] = " ".join([Path(argvs[tool][0]).name, *argvs[tool][1:]])
    result["load_after"] = loadavg()
    if all(result[tool]["exit"] == 0 for tool in outs):
        try:
            result["comparison"] = compare_outputs(outs["layerswap"], outs["mergekit"])
            result["equal"] = describe_comparison(result["comparison"])
        except AssertionError as error:  # another dtype: the values compared in Layerswap's
            result["comparison"] = cast_comparison(outs["layerswap"], outs["mergekit"])
            result["equal"] = f"{error}; {result['comparison']['text']}"
    for out in outs.values():
        remove(out)
    return result


def compile_layerswap(source: Path) -> None:
    """Layerswap's modules and its virtualenv compiled to bytecode once, before any timing, as
    scripts/run.sh compiles them (pip compiled mergekit's at install): where
    PYTHONDONTWRITEBYTECODE is set, each run would otherwise compile them again."""
    packages = [source / p for p in ("core", "engine", "layerswap", "service", "worker")]
    site = sorted((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    compileall = [str(ROOT / ".venv" / "bin" / "python"), "-m", "compileall", "-q", "-j", "0"]
    subprocess.run([*compileall, *map(str, packages + site)], check=False, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--mergekit-timeout", type=int, default=600)
    parser.add_argument("--layerswap-source", help="import Layerswap from this directory")
    parser.add_argument(
        "--no-fsync", action="store_true", help="Layerswap without fsync, as mergekit writes"
    )
    args = parser.parse_args()
    names = args.names or sorted(p.stem for p in CONFIGS.glob("*.yml"))
    WORK.mkdir(parents=True, exist_ok=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    compile_layerswap(Path(args.layerswap_source or ROOT))
    for name in names:
        result = run_one(name, args.mergekit_timeout, args.layerswap_source, args.no_fsync)
        with open(RESULTS_DIR / "mergekit-methods.jsonl", "a") as out:
            out.write(json.dumps(result) + "\n")
        brief = {t: (result[t]["wall_s"], round(result[t]["peak_rss_mb"]), result[t]["exit"])
                 for t in ("layerswap", "mergekit")}  # fmt: skip
        print(name, brief, result.get("equal", "not compared"), flush=True)


if __name__ == "__main__":
    main()
