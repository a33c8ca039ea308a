"""Runs mergekit 0.1.5 (bench/setup.sh's .venv-bench) on a config and measures ulp distances.

The parity tests need it: a missing .venv-bench fails them with how to make one, never skips,
so a CI without it cannot pass silently.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
MERGEKIT = ROOT / ".venv-bench" / "bin" / "mergekit-yaml"


def run_mergekit(config: dict[str, Any], out: Path) -> Path:
    if not MERGEKIT.exists():
        pytest.fail(
            f"{MERGEKIT} is missing: run `bash bench/setup.sh` (scripts/test.sh does) to install "
            "mergekit 0.1.5 for the parity tests",
            pytrace=False,
        )
    config_file = out.with_suffix(".yml")
    config_file.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [str(MERGEKIT), str(config_file), str(out), "--allow-crimes"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mergekit failed:\n{done.stderr[-3000:]}"
    return out


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
