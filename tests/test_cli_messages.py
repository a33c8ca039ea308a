"""What `layerswap` says when something stands in the way, as a real subprocess: the command
line's own advice (flags, free space), a mergekit config's errors by the config's fields, a dry
run's per-layer (and per-module) values, and a port another process holds."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

from tests.helpers import write_recipe
from tests.test_cli import LAYERSWAP


def layerswap(*args: Any, cwd: Path, env: dict[str, str] | None = None) -> Any:
    """The command with the suite's environment, plus `env`."""
    extra = {"LAYERSWAP_CACHE_DIR": str(cwd / ".cache"), "CI": "true", **(env or {})}
    return subprocess.run(
        [str(LAYERSWAP), *map(str, args)], cwd=cwd, env={**os.environ, **extra},
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def swap(examples: Path, tmp_path: Path) -> Path:
    return write_recipe(
        tmp_path / "swap.yaml",
        {
            "method": "layer_swap",
            "experts": {"task": [examples / "math"], "language": [examples / "swh"]},
            "params": {"bottom": 1, "top": 1},
        },
    )


def one_error_line(proc: Any) -> str:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return str(lines[0])


def test_an_existing_output_names_the_flag(examples: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = one_error_line(layerswap("merge", swap(examples, tmp_path), out, "-q", cwd=tmp_path))
    assert line.startswith("layerswap: error [output_error]: ")
    assert line.endswith("already exists and is not empty; pass --overwrite to replace it")
    assert "use overwrite" not in line


def test_a_full_disk_says_what_to_free_here(
    examples: Path, tmp_path: Path, small_filesystem: Any
) -> None:
    out = small_filesystem(64 * 1024) / "merged"
    line = one_error_line(layerswap("merge", swap(examples, tmp_path), out, "-q", cwd=tmp_path))
    assert line.startswith("layerswap: error [disk_full]: the output needs ")
    assert "free space on that disk (or remove output directories" in line
    assert "/v1/" not in line and "submit" not in line  # the API's words, not the CLI's
    assert not out.exists()


def mergekit_error(config: dict[str, Any], tmp_path: Path) -> str:
    path = write_recipe(tmp_path / "config.yml", config)
    line = one_error_line(layerswap("merge", path, "--dry-run", cwd=tmp_path))
    return line.removeprefix("layerswap: error [invalid_recipe]: ")


def test_mergekit_errors_name_the_configs_field(examples: Path, tmp_path: Path) -> None:
    one_layer = {"model": str(examples / "math"), "layer_range": [0, 1]}
    stacked = {"merge_method": "passthrough", "slices": [{"sources": [one_layer]}] * 300}
    assert mergekit_error(stacked, tmp_path).startswith("slices: List should have at most 256")
    models = [
        {"model": str(examples / "math"), "parameters": {"weight": [1.0] * 300}},
        {"model": str(examples / "swh"), "parameters": {"weight": 1.0}},
    ]
    too_long = mergekit_error({"merge_method": "linear", "models": models}, tmp_path)
    assert too_long.startswith("models.0.parameters.weight: List should have at most 256 items")


def dry_run(recipe: dict[str, Any], tmp_path: Path) -> str:
    proc = layerswap("merge", write_recipe(tmp_path / "r.yaml", recipe), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return str(proc.stdout)


def second_weights(lines: list[str]) -> list[float]:
    """models[1]'s coefficient (slerp's t) on each line."""
    return [float(re.search(r"([\d.]+)×models\[1\]", line).group(1)) for line in lines]  # type: ignore[union-attr]


def test_a_dry_run_shows_each_layers_t(examples: Path, tmp_path: Path) -> None:
    models = [examples / "math", examples / "swh"]
    shown = dry_run({"method": "slerp", "models": models, "params": {"t": [0, 0.5, 1]}}, tmp_path)
    rows = [line for line in shown.splitlines() if re.match(r"^\d+\s+slerp", line)]
    assert second_weights(rows) == [0, 0.2, 0.4, 0.6, 0.8, 1]  # 6 layers along the gradient

    filtered = {"t": [{"filter": "self_attn", "value": [0, 1]},
                      {"filter": "mlp", "value": [1, 0]}, {"value": 0.5}]}  # fmt: skip
    shown = dry_run({"method": "slerp", "models": models, "params": filtered}, tmp_path)
    attention = [line for line in shown.splitlines() if "self_attn: " in line]
    mlp = [line for line in shown.splitlines() if "mlp: " in line]
    assert second_weights(attention) == [0, 0.2, 0.4, 0.6, 0.8, 1]
    assert second_weights(mlp) == [1, 0.8, 0.6, 0.4, 0.2, 0]
    norms = [line for line in shown.splitlines() if "input_layernorm" in line]
    assert len(norms) == 6 and set(second_weights(norms)) == {0.5}


def test_a_taken_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {"LAYERSWAP_DATA_DIR": str(tmp_path / "data")}
        by_flag = layerswap("serve", "--port", port, cwd=tmp_path, env=env)
        by_env = layerswap("serve", cwd=tmp_path, env={**env, "LAYERSWAP_PORT": str(port)})
    for proc in (by_flag, by_env):
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (
            f"layerswap: error [port_taken]: port {port} is taken (by another process); "
            "set --port / LAYERSWAP_PORT=<another port>\n"
        )
        assert "serving on" not in proc.stdout
    assert not (tmp_path / "data").exists()  # stopped before creating anything
