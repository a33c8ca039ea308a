"""The `layerswap` command line, run as a real subprocess from the project's environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.helpers import leftovers, write_recipe
from tests.reference import load, sha256

LAYERSWAP = Path(sys.executable).parent / "layerswap"


def layerswap(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LAYERSWAP_CACHE_DIR": str(cwd / ".cache"), "CI": "true"}
    return subprocess.run(
        [str(LAYERSWAP), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def relative(path: Path, start: Path) -> str:
    return os.path.relpath(path, start)


@pytest.fixture
def swap_yaml(llama: Family, tmp_path: Path) -> Path:
    """A layer-swap recipe whose sources are relative to the recipe file."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    return write_recipe(
        recipes / "swap.yaml",
        {
            "method": "layer_swap",
            "experts": {
                "task": [relative(llama.task, recipes)],
                "language": [relative(llama.language, recipes)],
            },
            "params": {"bottom": 1, "top": 1, "bottom_transition": 1, "non_layer": "average"},
        },
    )


def test_merge_success(swap_yaml: Path, llama: Family, run_merge: Any, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    proc = layerswap("merge", swap_yaml, "--out", out, "-q", "--no-fsync", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "merged into" in proc.stdout
    assert proc.stderr == ""
    assert (out / "model.safetensors").is_file()
    manifest = json.loads((out / "layerswap.json").read_text())
    for name, digest in manifest["outputs"].items():
        assert sha256(out / name) == digest
    # Same weights as the engine API produces for the same recipe with absolute paths.
    api = run_merge(
        {
            "method": "layer_swap",
            "experts": {"task": [llama.task], "language": [llama.language]},
            "params": {"bottom": 1, "top": 1, "bottom_transition": 1},
        }
    )
    assert sha256(out / "model.safetensors") == sha256(api.out_dir / "model.safetensors")
    assert leftovers(out) == ["merged"]


def test_merge_with_progress_bar(swap_yaml: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    proc = layerswap("merge", swap_yaml, "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tensors" in proc.stderr  # the bar shows bytes and tensors
    assert (out / "layerswap.json").is_file()


def test_collector_on_and_start_up_objects_frozen_once_a_command_is_imported(
    tmp_path: Path,
) -> None:
    """main() pauses the garbage collector while a command's module is imported, then turns it
    back on with what the imports made frozen (left out of every later collection)."""
    code = (
        "import atexit, gc, sys\n"
        "from layerswap.cli import main\n"
        "atexit.register(lambda: print(gc.isenabled(), gc.get_freeze_count() > 10000))\n"
        "sys.argv = ['layerswap', 'merge', '--help']\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Usage: layerswap merge" in done.stdout
    assert done.stdout.splitlines()[-1] == "True True"


def test_dry_run_prints_table_and_writes_nothing(swap_yaml: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    proc = layerswap("merge", swap_yaml, "--out", out, "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    expected = [
        r"^0\s+language\s+language\[0\]$",
        r"^1\s+transition\s+0\.5×task\[0\] \+ 0\.5×language\[0\]$",
        r"^2\s+task\s+task\[0\]$",
        r"^4\s+task\s+task\[0\]$",
        r"^5\s+language\s+language\[0\]$",
        r"^non-layer\s+average\s+",
    ]
    for pattern in expected:
        assert any(re.match(pattern, line) for line in lines), (pattern, proc.stdout)
    assert not out.exists()
    assert leftovers(out) == []


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        (
            {
                "method": "layer_swap",
                "experts": {"task": ["a"], "language": ["b"]},
                "params": {"foo": 1},
            },
            "params.foo",
        ),
        ({"method": "ties", "models": ["a", "b"]}, "base"),
        (
            {"method": "ties", "base": "c", "models": ["a", "b"], "params": {"density": 0}},
            "params.density",
        ),
        ({"method": "dare", "models": ["a", "b"]}, "method"),
        ({"method": "slerp", "models": ["a"], "params": {"t": 0.5}}, "models"),
        (
            {
                "method": "passthrough",
                "models": ["a"],
                "params": {"slices": [{"sources": [{"model": "a", "layer_range": [3, 1]}]}]},
            },
            "params.slices.0.sources.0.layer_range",
        ),
        (["not", "a", "mapping"], "recipe"),
    ],
    ids=[
        "unknown-key",
        "missing-base",
        "density",
        "method",
        "slerp-one-model",
        "passthrough-range",
        "non-mapping",
    ],
)
def test_invalid_recipe_one_line_error(recipe: Any, field: str, tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "bad.yaml", recipe)
    out = tmp_path / "merged"
    proc = layerswap("merge", path, "--out", out, cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("layerswap: error [invalid_recipe]")
    assert f"]: {field}" in lines[0]
    assert leftovers(out) == []


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: soup\nmodels: [a, b\n")
    for path in (bad, tmp_path / "missing.yaml"):
        proc = layerswap("merge", path, "--out", tmp_path / "merged", cwd=tmp_path)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "recipe" in lines[0] and path.name in lines[0]


def test_layer_budget_error_names_params(llama: Family, tmp_path: Path) -> None:
    path = write_recipe(
        tmp_path / "swap.yaml",
        {"method": "layer_swap", "experts": {"task": [llama.task], "language": [llama.language]}},
    )  # paper defaults b=5, u=2 > 6 layers
    out = tmp_path / "merged"
    for extra in ([], ["--dry-run"]):
        proc = layerswap("merge", path, "--out", out, *extra, cwd=tmp_path)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "]: params" in lines[0], proc.stderr
    assert leftovers(out) == []


def test_bad_checkpoint_names_file(llama: Family, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama.language, bad)
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    path = write_recipe(tmp_path / "soup.yaml", {"method": "soup", "models": [llama.task, bad]})
    out = tmp_path / "merged"
    proc = layerswap("merge", path, "--out", out, "-q", cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "[invalid_checkpoint]" in lines[0] and str(bad / "model.safetensors") in lines[0]
    assert leftovers(out) == []


def test_existing_output_and_overwrite(swap_yaml: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = layerswap("merge", swap_yaml, "--out", out, "-q", cwd=tmp_path)
    assert proc.returncode != 0
    assert "[output_error]" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"
    proc = layerswap("merge", swap_yaml, "--out", out, "-q", "--overwrite", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (out / "keep.txt").exists()
    assert (out / "model.safetensors").is_file()
    assert leftovers(out) == ["merged"]


def test_device_cuda(swap_yaml: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    proc = layerswap("merge", swap_yaml, "--out", out, "-q", "--device", "cuda", cwd=tmp_path)
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stderr
        assert (out / "model.safetensors").is_file()
    else:
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "[device_unavailable]" in lines[0], proc.stderr
        assert leftovers(out) == []


def test_examples_then_every_recipe(tmp_path: Path) -> None:
    """`layerswap examples` makes checkpoints and recipes a newcomer can merge right away."""
    examples = tmp_path / "examples"
    proc = layerswap("examples", examples, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("base", "math", "swh"):
        assert (examples / name / "config.json").is_file()
        assert (examples / name / "model.safetensors").is_file()
    recipes = sorted(examples.glob("*.yaml"))
    assert {p.stem for p in recipes} >= {"layer_swap", "soup", "task_arithmetic", "ties"}
    for recipe in recipes:
        out = tmp_path / f"out-{recipe.stem}"
        proc = layerswap("merge", recipe, "--out", out, "-q", "--no-fsync", cwd=tmp_path)
        assert proc.returncode == 0, (recipe.name, proc.stderr)
        merged = load(out)
        assert set(merged) == set(load(examples / "base"))


def test_analyze(llama: Family, tmp_path: Path) -> None:
    from tests.reference import magnitude

    out = tmp_path / "analysis"
    proc = layerswap(
        "analyze",
        "--base",
        llama.base,
        "--expert",
        f"math={llama.task}",
        "--expert",
        f"swh={llama.language}",
        "--out",
        out,
        "--task",
        "math",
        "--language",
        "swh",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "analysis.json").read_text())
    assert set(data["experts"]) == {"math", "swh"}
    assert data["layers"] == 6
    for label, path in (("math", llama.task), ("swh", llama.language)):
        expert = data["experts"][label]
        assert len(expert["fraction"]) == 6
        assert all(len(row) == len(data["kinds"]) for row in expert["fraction"])
        assert all(0.0 <= f <= 1.0 for row in expert["fraction"] for f in row)
        # DESIGN §3.3 magnitude, recomputed independently
        reference = magnitude(load(path), load(llama.base))
        assert expert["magnitude"] == pytest.approx(reference, rel=1e-5)
    # The fixtures change the language expert most at both ends, the task expert in the middle.
    suggestion = data["suggestion"]
    assert suggestion["heuristic"] is True
    assert (suggestion["bottom"], suggestion["top"]) == (1, 1)
    assert "bottom=1 top=1" in proc.stdout


def test_analyze_bad_expert_one_line_error(llama: Family, tmp_path: Path) -> None:
    proc = layerswap(
        "analyze",
        "--base",
        llama.base,
        "--expert",
        tmp_path / "nowhere",
        "--out",
        tmp_path / "analysis",
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nowhere" in lines[0], proc.stderr
    assert not (tmp_path / "analysis").exists()


@pytest.mark.parametrize("queues", ["bogus", "merge,gpu", ","])
def test_worker_refuses_unknown_queues(tmp_path: Path, queues: str) -> None:
    result = layerswap("worker", "--queues", queues, cwd=tmp_path)
    assert result.returncode == 2
    assert "error [invalid_queues]" in result.stderr and "merge, eval" in result.stderr


def test_worker_refuses_invalid_settings(tmp_path: Path) -> None:
    env = {**os.environ, "LAYERSWAP_STALE_AFTER_S": "1", "LAYERSWAP_HEARTBEAT_INTERVAL_S": "2"}
    result = subprocess.run(
        [str(Path(sys.executable).parent / "layerswap"), "worker"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "invalid_settings" in result.stderr and "stale_after_s" in result.stderr


@pytest.mark.parametrize(
    ("device", "problem"),
    # No host has 100 GPUs (CI's has none), so cuda:99 is refused everywhere.
    [
        ("tpu", "should match pattern"),
        ("cuda:x", "should match pattern"),
        ("cuda:99", "'cuda:99' requested but"),
    ],
)
@pytest.mark.parametrize("command", ["worker", "serve"])
def test_merge_device_is_checked_at_start(
    tmp_path: Path, command: str, device: str, problem: str
) -> None:
    env = {**os.environ, "LAYERSWAP_MERGE_DEVICE": device, "LAYERSWAP_DATA_DIR": str(tmp_path)}
    result = subprocess.run(
        [str(Path(sys.executable).parent / "layerswap"), command],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "error [invalid_settings]: merge_device:" in result.stderr
    assert problem in result.stderr


HELP_PROBE = """
import sys
from click.testing import CliRunner
from layerswap.cli import cli
result = CliRunner().invoke(cli, ["--help"])
assert result.exit_code == 0, result.output
loaded = sorted(m for m in ("fastapi", "celery", "torch", "service", "worker", "core")
                if m in sys.modules)
print(result.output)
print("LOADED", loaded)
"""


def test_help_lists_every_command_without_loading_them() -> None:
    """`layerswap --help` reads the command table: no command's module (the web framework,
    Celery, torch) is imported to list them."""
    from layerswap.cli import COMMANDS, cli

    done = subprocess.run([sys.executable, "-c", HELP_PROBE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout
    listed = re.findall(r"^  (\w+)\s{2,}(.+)$", done.stdout, flags=re.MULTILINE)
    assert dict(listed) == {name: line for name, (_, line) in COMMANDS.items()}
    for name in COMMANDS:  # every entry names a real command of that name
        command = cli.get_command(None, name)  # type: ignore[arg-type]
        assert command is not None and command.name == name


@pytest.fixture
def linear_config(llama: Family, tmp_path: Path) -> Path:
    """A mergekit config (linear), its models relative to the file as mergekit-yaml reads them."""
    path = tmp_path / "linear.yml"
    models = [relative(llama.task, tmp_path), relative(llama.language, tmp_path)]
    path.write_text(
        "merge_method: linear\ndtype: float32\nmodels:\n"
        + "".join(f"  - model: {m}\n    parameters: {{weight: 0.5}}\n" for m in models)
    )
    return path


def test_merge_takes_mergekit_yamls_positional_output_and_flags(
    linear_config: Path, tmp_path: Path
) -> None:
    """`layerswap merge CONFIG OUT` as `mergekit-yaml CONFIG OUT`, with its common flags: each
    accepted one says on stderr why it changes nothing here; the result is the --out one's."""
    flags = ["--copy-tokenizer", "--lazy-unpickle", "--low-cpu-memory", "--out-shard-size", "1B"]
    proc = layerswap("merge", linear_config, "positional", *flags, "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--copy-tokenizer", "--lazy-unpickle", "--low-cpu-memory", "--out-shard-size"):
        assert f"note: {flag} (mergekit-yaml's): " in proc.stderr
    named = layerswap("merge", linear_config, "--out", "named", "-q", cwd=tmp_path)
    assert named.returncode == 0, named.stderr
    assert "note:" not in named.stderr
    for name in ("model.safetensors", "config.json"):
        assert sha256(tmp_path / "positional" / name) == sha256(tmp_path / "named" / name)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["out", "--allow-crimes"], "--allow-crimes: Layerswap merges checkpoints of one arch"),
        (["out", "--trust-remote-code"], "--trust-remote-code: Layerswap never runs code"),
        (["out", "--out", "other"], "OUT_PATH or --out, not both"),
        ([], "missing the output directory: OUT_PATH (or --out)"),
    ],
)
def test_merge_refuses_mergekit_flags_it_cannot_honour(
    linear_config: Path, tmp_path: Path, args: list[str], says: str
) -> None:
    proc = layerswap("merge", linear_config, *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert says in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "other").exists()


def test_merge_cuda_flag_asks_for_the_gpu(linear_config: Path, tmp_path: Path) -> None:
    """--cuda is honoured as --device cuda: on a machine without one, the device's error."""
    proc = layerswap("merge", linear_config, "out", "--cuda", cwd=tmp_path)
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "out" / "model.safetensors").is_file()
    else:
        assert proc.returncode == 1
        assert "cuda" in proc.stderr.lower() and "error" in proc.stderr
        assert not (tmp_path / "out").exists()
