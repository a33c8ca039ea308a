"""Small test helpers that do not touch the engine."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

T = TypeVar("T")


def stringify(value: Any) -> Any:
    """Paths -> str throughout a recipe (the schema takes strings)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: stringify(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [stringify(v) for v in value]
    return value


def leftovers(out: Path) -> list[str]:
    """Anything the engine may have left beside `out`: the directory or staging/old copies."""
    parent = out.parent
    if not parent.exists():
        return []
    return sorted(
        p.name
        for p in parent.iterdir()
        if p.name == out.name or p.name.startswith((f".{out.name}.staging-", f".{out.name}.old-"))
    )


def write_recipe(path: Path, recipe: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(stringify(recipe), sort_keys=False), encoding="utf-8")
    return path


def wait_for(
    condition: Callable[[], T],
    what: str | Callable[[], str],
    timeout: float = 60.0,
    *,
    interval: float = 0.02,
) -> T:
    """`condition()`'s first truthy value, asked every `interval` s: a poll, for a state no event
    announces (another process's, a server's, a row's). Fails the test at the deadline with an
    AssertionError naming `what` (a callable is asked then, to describe the last state seen)."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {described}")
        time.sleep(interval)
    return found


def healthy(url: str) -> bool:
    """Whether the Layerswap API at `url` answers its liveness check."""
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def stop(process: subprocess.Popen[Any], signal: int) -> None:
    """Ask a server process to stop with `signal`; kill it after 30 s."""
    process.send_signal(signal)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name` that `build(directory)` fills, made once per test run. With
    pytest-xdist each worker has its own session fixtures: the first worker to ask builds under
    the run's shared temporary root while the others wait on a file lock, then every worker
    reads the same files (as the tests of one process share a session fixture's)."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's root, above each worker's own basetemp
    target, done = root / name, root / f"{name}.done"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)  # a build that failed half-way
            target.mkdir()
            build(target)
            done.touch()
    return target
