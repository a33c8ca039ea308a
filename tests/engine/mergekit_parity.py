"""Runs mergekit 0.1.5 (bench/setup.sh's .venv-bench) on a config and measures ulp distances.

The parity tests need it: a missing .venv-bench fails them with how to make one, never skips,
so a CI without it cannot pass silently. mergekit-yaml's command runs in one long-lived process
(mergekit_runner.py), started at the first config: its start-up is paid once per test session.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from engine.mergekit import translate
from tests.reference import load as load_tensors

ROOT = Path(__file__).resolve().parents[2]
MERGEKIT = ROOT / ".venv-bench" / "bin" / "mergekit-yaml"
RUNNER = Path(__file__).with_name("mergekit_runner.py")


def run_mergekit(config: dict[str, Any], out: Path) -> Path:
    config_file = out.with_suffix(".yml")
    config_file.write_text(yaml.safe_dump(config))
    reply = mergekit_reply(config_file, out)
    assert reply["ok"], f"mergekit failed:\n{reply['error']}"
    return out


def mergekit_reply(config_file: Path, out: Path, *args: str) -> dict[str, Any]:
    """mergekit-yaml CONFIG_FILE OUT --allow-crimes ARGS, run in the one long-lived process:
    {"ok": true}, or {"ok": false, "error": its traceback's end}."""
    if not MERGEKIT.exists():
        pytest.fail(
            f"{MERGEKIT} is missing: run `bash bench/setup.sh` (scripts/test.sh does) to install "
            "mergekit 0.1.5 for the parity tests",
            pytrace=False,
        )
    return _runner().run(config_file, out, args)


class _Runner:
    """mergekit_runner.py in .venv-bench's Python, its log in a temporary file."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the process runs)
        read_end, write_end = os.pipe()
        self.process = subprocess.Popen(
            [str(MERGEKIT.with_name("python")), str(RUNNER), str(write_end)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, text=True,
            pass_fds=(write_end,),
        )  # fmt: skip
        os.close(write_end)
        self.replies = os.fdopen(read_end)
        atexit.register(self.close)

    def run(self, config: Path, out: Path, args: tuple[str, ...] = ()) -> dict[str, Any]:
        """mergekit-yaml CONFIG OUT --allow-crimes ARGS: {"ok": true} or {"ok": false, "error"}."""
        assert self.process.stdin is not None
        request = {"config": str(config), "out": str(out), "args": list(args)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.replies.readline()
        if not line:  # the process died: its log says why
            self.log.seek(0)
            pytest.fail(f"mergekit's process ended:\n{self.log.read()[-3000:].decode()}")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


@functools.cache
def _runner() -> _Runner:
    return _Runner()


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Largest distance in representable values between same-dtype tensors (0 = equal bits)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.numel() == 0:
        return 0
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    as_int = bits[actual.dtype]

    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(as_int).to(torch.int64)
        return torch.where(i < 0, -(i & ~torch.iinfo(as_int).min), i)  # sign-magnitude -> line

    return int((ordered(actual) - ordered(expected)).abs().max())


def worst_ulps(ours: Path, theirs: Path) -> int:
    """The largest ulp distance between two outputs' tensors (the same names in both)."""
    mine, reference = load_tensors(ours), load_tensors(theirs)
    assert set(mine) == set(reference)
    worst = max(ulp_distance(mine[k], reference[k]) for k in mine)
    print(f"max ulp distance to mergekit: {worst}")
    return worst


def family_config(
    method: str, fam: Any, models: list[tuple[str, dict[str, Any]]], out_dtype: str,
    *, dtype: str = "float32", **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """A mergekit config over a test family's checkpoints: (role, parameters) per model."""
    return {
        "merge_method": method,
        "models": [{"model": str(getattr(fam, m)), "parameters": p} for m, p in models],
        "dtype": dtype,
        "out_dtype": out_dtype,
        **extra,
    }


def translated_merge(config: dict[str, Any], run_merge: Any, **options: Any) -> Path:
    """The merge of the mergekit config as Layerswap translates it."""
    translated = translate(config, is_local=lambda source: Path(source).is_dir())
    recipe = translated.recipe.model_dump(mode="json", by_alias=True, exclude_none=True)
    return Path(run_merge(recipe, **options).out_dir)
