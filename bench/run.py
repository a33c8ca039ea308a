"""Time `layerswap merge` against mergekit on the same synthetic checkpoints.

For one preset made by make_checkpoints.py, every case below is run under `/usr/bin/time -v`
(wall clock and "Maximum resident set size", which counts mapped file pages too):

    layer_swap  layerswap (default options: fsync on), layerswap --no-fsync,
                layerswap with an empty sha256 cache, mergekit
    soup        layerswap, mergekit                    (uniform soup of task + lang)
    ties        layerswap, mergekit                    (TIES over base, density 0.5)
    nuslerp, model_stock (with --methods): layerswap, mergekit   (over base + task + lang)
    copy        cp -r of one input model               (the physical reference), and the same
                followed by `sync` of the copied files (durable, like layerswap's default)

Every input is hashed into layerswap's warm sha256 cache first, untimed. Each case gets
`--warmup` untimed runs (they fill the page cache), then `--reps` timed runs, round-robin over
the cases so that background load drifts over all of them alike. Before every run the output
directory is removed (and `sync` run) and the run's inputs are read into the page cache.
Results: bench/results/<preset>.json and bench/results/<preset>.md. With --verify (the
default) the last outputs of the two tools are compared tensor by tensor, layer swap and soup
are also checked against a reference computed from the inputs, and nuslerp and model_stock
against mergekit computing in float32 (run once more, untimed), as layerswap does.

    .venv/bin/python bench/run.py --preset small
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DATA_DIR = BENCH_DIR / "data"
RESULTS_DIR = BENCH_DIR / "results"
LAYERSWAP = ROOT / ".venv" / "bin" / "layerswap"
MERGEKIT = ROOT / ".venv-bench" / "bin" / "mergekit-yaml"
TIME = Path("/usr/bin/time")
METHODS = ("layer_swap", "soup", "ties", "slerp", "passthrough")
# mergekit's sparsifying task-vector methods: run with --methods (not by default: mergekit's
# DELLA alone takes ~20 minutes on the large preset). Each over base + [task, lang], weight 1.0
# and density 0.5 per model, with the methods' other defaults (gamma 0.01, epsilon 0.15).
SPARSE_METHODS = ("dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della",
                  "della_linear")  # fmt: skip
SPARSE_EXTRA = {"breadcrumbs": {"gamma": 0.01}, "breadcrumbs_ties": {"gamma": 0.01},
                "della": {"epsilon": 0.15}, "della_linear": {"epsilon": 0.15}}  # fmt: skip
# mergekit's nuslerp (over task vectors) and model_stock: run with --methods. mergekit computes
# them in its dtype, bf16 here, where layerswap computes in float32: their outputs are also
# compared with mergekit's computing in float32 (dtype float32, out_dtype bfloat16; untimed).
ANGLE_METHODS = ("nuslerp", "model_stock")
READS = {"layer_swap": ("task", "lang"), "soup": ("task", "lang"), "ties": ("base", "task", "lang"),
         "slerp": ("task", "lang"), "passthrough": ("task", "lang"),
         **dict.fromkeys(SPARSE_METHODS + ANGLE_METHODS, ("base", "task", "lang"))}  # fmt: skip
TOOLS = ("layerswap", "mergekit", "cp")
# The paper's swap for 32 layers is bottom=5, top=2; a 16-layer model gets a proportional one.
SWAP_FOR_LAYERS = {32: (5, 2), 16: (3, 1)}


@dataclass(frozen=True)
class Case:
    method: str  # layer_swap | soup | ties | copy
    tool: str  # layerswap | mergekit | cp
    variant: str  # "" or e.g. "--no-fsync"
    argv: tuple[str, ...]
    out: Path
    env: tuple[tuple[str, str], ...] = ()
    fresh_cache: bool = False  # layerswap: a new, empty sha256 cache for every run
    inputs: tuple[Path, ...] = ()  # checkpoint directories read into the page cache first

    @property
    def key(self) -> str:
        return f"{self.method}/{self.tool}{(' ' + self.variant) if self.variant else ''}"


@dataclass
class Measurement:
    wall_s: float
    max_rss_kb: int
    cpu_s: float = 0.0  # user + system time of the command and its children
    steal: float = 0.0  # share of the machine's CPU time the hypervisor took during the run


@dataclass
class CaseResult:
    method: str
    tool: str
    variant: str
    command: str
    runs: list[Measurement] = field(default_factory=list)

    @property
    def median_wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def peak_rss_mb(self) -> float:
        return max(r.max_rss_kb for r in self.runs) * 1024 / 1e6


# -- recipes and configs ---------------------------------------------------------------------
def swap_sizes(layers: int) -> tuple[int, int]:
    if layers in SWAP_FOR_LAYERS:
        return SWAP_FOR_LAYERS[layers]
    return max(1, round(layers * 5 / 32)), max(1, round(layers * 2 / 32))


def layer_owners(layers: int, bottom: int, top: int) -> list[str]:
    """Which expert each layer of a layer swap (no transitions) comes from."""
    return ["lang" if i < bottom or i >= layers - top else "task" for i in range(layers)]


def layerswap_recipes(models: dict[str, Path], layers: int) -> dict[str, dict[str, Any]]:
    bottom, top = swap_sizes(layers)
    task, lang, base = (str(models[k]) for k in ("task", "lang", "base"))
    return {
        "layer_swap": {
            "method": "layer_swap",
            "experts": {"task": [task], "language": [lang]},
            "params": {"bottom": bottom, "top": top, "non_layer": "average"},
        },
        "soup": {"method": "soup", "models": [task, lang], "params": {"weights": "uniform"}},
        "ties": {
            "method": "ties",
            "base": base,
            "models": [task, lang],
            "params": {"density": 0.5, "lambda": 1.0, "normalize": True},
        },
        "slerp": {"method": "slerp", "models": [task, lang], "params": {"t": 0.5}},
        "passthrough": {
            "method": "passthrough",
            "models": [task, lang],
            "params": {"slices": [{"sources": [s]} for s in frankenmerge(task, lang, layers)]},
        },
        **{
            method: {
                "method": method,
                "base": base,
                "models": [task, lang],
                "params": {"weights": [1.0, 1.0], "density": 0.5, **SPARSE_EXTRA.get(method, {})},
            }
            for method in SPARSE_METHODS
        },
        "nuslerp": {
            "method": "nuslerp",
            "base": base,
            "models": [task, lang],
            "params": {"weights": [1.0, 1.0]},
        },
        "model_stock": {"method": "model_stock", "base": base, "models": [task, lang]},
    }


def frankenmerge(task: str, lang: str, layers: int) -> list[dict[str, Any]]:
    """A passthrough 1.5x as deep: all the task expert's layers, then the top half of the
    language expert's (mergekit's `slices`, one source each)."""
    return [
        {"model": task, "layer_range": [0, layers]},
        {"model": lang, "layer_range": [layers // 2, layers]},
    ]


def _weight(owner: str, model: str, non_layer_filters: tuple[str, ...]) -> Any:
    """A mergekit weight: 0.5 for the averaged non-layer tensors named by the filters, else
    1.0 for the model that owns the layer and 0.0 for the other."""
    layer_weight = 1.0 if owner == model else 0.0
    if not non_layer_filters:
        return layer_weight
    conditions: list[dict[str, Any]] = [{"filter": f, "value": 0.5} for f in non_layer_filters]
    return [*conditions, {"value": layer_weight}]


def mergekit_layer_swap_slices(layers: int, bottom: int, top: int) -> list[dict[str, Any]]:
    """`linear` slices that reproduce a layer swap with averaged non-layer tensors.

    mergekit merges the embeddings with the parameters of the first slice and the final norm
    and lm_head with those of the last. So the first and the last layer are slices of their own
    over both experts, with weights 1/0 for the layer and 0.5/0.5 (by name filter) for the
    non-layer tensors; the layers between are single-model slices (one input each, no
    arithmetic beyond mergekit's linear pass over one tensor).
    """
    if layers < 2:
        raise ValueError("need at least 2 layers")
    owners = layer_owners(layers, bottom, top)

    def both(i: int, filters: tuple[str, ...]) -> dict[str, Any]:
        return {
            "sources": [
                {
                    "model": m,
                    "layer_range": [i, i + 1],
                    "parameters": {"weight": _weight(owners[i], m, filters)},
                }
                for m in ("lang", "task")
            ]
        }

    slices = [both(0, ("embed_tokens",))]
    i = 1
    while i < layers - 1:  # runs of consecutive middle layers with the same owner
        j = i
        while j < layers - 1 and owners[j] == owners[i]:
            j += 1
        source = {"model": owners[i], "layer_range": [i, j], "parameters": {"weight": 1.0}}
        slices.append({"sources": [source]})
        i = j
    slices.append(both(layers - 1, ("lm_head", "model.norm.")))
    return slices


def mergekit_configs(models: dict[str, Path], layers: int) -> dict[str, dict[str, Any]]:
    bottom, top = swap_sizes(layers)
    slices = mergekit_layer_swap_slices(layers, bottom, top)
    for s in slices:
        for source in s["sources"]:
            source["model"] = str(models[source["model"]])
    task, lang, base = (str(models[k]) for k in ("task", "lang", "base"))
    return {
        "layer_swap": {
            "merge_method": "linear",
            "slices": slices,
            "parameters": {"normalize": True},
            "dtype": "bfloat16",
        },
        "soup": {
            "merge_method": "linear",
            "models": [
                {"model": task, "parameters": {"weight": 0.5}},
                {"model": lang, "parameters": {"weight": 0.5}},
            ],
            "parameters": {"normalize": True},
            "dtype": "bfloat16",
        },
        "ties": {
            "merge_method": "ties",
            "base_model": base,
            "models": [
                {"model": task, "parameters": {"weight": 1.0, "density": 0.5}},
                {"model": lang, "parameters": {"weight": 1.0, "density": 0.5}},
            ],
            "parameters": {"normalize": True, "lambda": 1.0},
            "dtype": "bfloat16",
        },
        "slerp": {
            "merge_method": "slerp",
            "base_model": task,
            "models": [{"model": task}, {"model": lang}],
            "parameters": {"t": 0.5},
            "dtype": "bfloat16",
        },
        "passthrough": {
            "merge_method": "passthrough",
            "slices": [{"sources": [s]} for s in frankenmerge(task, lang, layers)],
            "dtype": "bfloat16",
        },
        **{
            method: {
                "merge_method": method,
                "base_model": base,
                "models": [
                    {"model": m, "parameters": {"weight": 1.0, "density": 0.5, **extra}}
                    for m in (task, lang)
                ],
                "dtype": "bfloat16",
            }
            for method, extra in ((m, SPARSE_EXTRA.get(m, {})) for m in SPARSE_METHODS)
        },
        "nuslerp": {
            "merge_method": "nuslerp",
            "base_model": base,
            "models": [
                {"model": task, "parameters": {"weight": 1.0}},
                {"model": lang, "parameters": {"weight": 1.0}},
            ],
            "dtype": "bfloat16",
        },
        "model_stock": {
            "merge_method": "model_stock",
            "base_model": base,
            "models": [{"model": task}, {"model": lang}],
            "dtype": "bfloat16",
        },
    }


def float32_config(config: dict[str, Any]) -> dict[str, Any]:
    """A mergekit config computing in float32 (rounded once to bf16): verification only."""
    return {**config, "dtype": "float32", "out_dtype": "bfloat16"}


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return path


# -- measuring -------------------------------------------------------------------------------
_WALL_RE = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)")
_RSS_RE = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")
_CPU_RE = re.compile(r"(?:User|System) time \(seconds\): ([\d.]+)")


def parse_time_v(text: str) -> Measurement:
    wall = _WALL_RE.search(text)
    rss = _RSS_RE.search(text)
    if not wall or not rss:
        raise ValueError(f"no wall clock / max RSS in /usr/bin/time output:\n{text}")
    seconds = 0.0
    for part in wall.group(1).split(":"):
        seconds = seconds * 60 + float(part)
    cpu = sum(float(x) for x in _CPU_RE.findall(text))
    return Measurement(seconds, int(rss.group(1)), cpu)


def cpu_times() -> list[int]:
    """The machine's CPU time counters (/proc/stat's first line, in ticks)."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def steal_share(before: list[int], after: list[int]) -> float:
    """Of the CPU time that passed, the share the hypervisor gave to other guests ("steal",
    the 8th counter): on a shared VM, the same command's wall time varies with it."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    return delta[7] / sum(delta) if sum(delta) else 0.0


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    for stale in path.parent.glob(f".{path.name}.*"):  # an interrupted run's staging dir
        shutil.rmtree(stale, ignore_errors=True)


def read_into_page_cache(directories: tuple[Path, ...]) -> None:
    """Read every file of the inputs once, untimed, so that each run starts from a warm page
    cache, as the figures claim: this machine's kernel reclaims page cache that stayed idle
    for about a minute (a DAMON pageout scheme), so without it a run after a long one (TIES'
    mergekit, 4-5 min) read its inputs from disk and took 2-3x as long."""
    buffer = bytearray(16 * 1024 * 1024)
    for directory in directories:
        for path in sorted(directory.iterdir()):
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


def run_case(case: Case, logs: Path, cache_root: Path) -> Measurement:
    remove(case.out)
    subprocess.run(["sync"], check=True)
    read_into_page_cache(case.inputs)
    env = {**os.environ, **dict(case.env)}
    if case.tool == "layerswap":
        cache = cache_root / ("cold-" + str(time.monotonic_ns()) if case.fresh_cache else "warm")
        env["LAYERSWAP_CACHE_DIR"] = str(cache)
    timing = logs / f"{case.key.replace('/', '_').replace(' ', '')}.time"
    log = timing.with_suffix(".log")
    counters = cpu_times()
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(TIME), "-v", "-o", str(timing), *case.argv],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, check=False,
        )  # fmt: skip
    if case.fresh_cache:
        shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{case.key} failed (exit {proc.returncode}); log {log}:\n{tail}")
    measured = parse_time_v(timing.read_text())
    measured.steal = steal_share(counters, cpu_times())
    return measured


# -- verification ------------------------------------------------------------------------------
class Tensors:
    """Lazy access to a checkpoint's tensors by name (single file or sharded)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Any] = {}
        self.where: dict[str, str] = {}
        for file in sorted(directory.glob("*.safetensors")):
            handle = safe_open(str(file), "pt")
            self.files[file.name] = handle
            for name in handle.keys():  # type: ignore[no-untyped-call]  # noqa: SIM118
                self.where[name] = file.name

    def names(self) -> list[str]:
        return sorted(self.where)

    def get(self, name: str) -> Any:
        return self.files[self.where[name]].get_tensor(name)


def compare_outputs(a: Path, b: Path) -> dict[str, Any]:
    """Tensor-by-tensor comparison of two merged checkpoints (bf16-aware)."""
    import torch

    ta, tb = Tensors(a), Tensors(b)
    report: dict[str, Any] = {
        "only_in_layerswap": sorted(set(ta.names()) - set(tb.names())),
        "only_in_mergekit": sorted(set(tb.names()) - set(ta.names())),
    }
    identical = differing = 0
    elements = elements_differing = 0
    max_abs = 0.0
    max_ulps = 0
    worst: list[tuple[float, str]] = []
    for name in sorted(set(ta.names()) & set(tb.names())):
        x, y = ta.get(name), tb.get(name)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise AssertionError(f"{name}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}")
        elements += x.numel()
        if torch.equal(x, y):
            identical += 1
            continue
        differing += 1
        diff = x.float() - y.float()
        mask = diff != 0
        elements_differing += int(mask.sum())
        tensor_max = float(diff.abs().max())
        max_abs = max(max_abs, tensor_max)
        if x.dtype in (torch.bfloat16, torch.float16):
            ulps = (x.view(torch.int16).int() - y.view(torch.int16).int()).abs()
            same_sign = (x.float().sign() == y.float().sign()) & mask
            if bool(same_sign.any()):
                max_ulps = max(max_ulps, int(ulps[same_sign].max()))
        worst.append((tensor_max, name))
    report.update({
        "tensors_compared": identical + differing, "tensors_identical": identical,
        "tensors_differing": differing, "elements": elements,
        "elements_differing": elements_differing,
        "fraction_elements_differing": elements_differing / max(1, elements),
        "max_abs_diff": max_abs, "max_ulp_diff_same_sign": max_ulps,
        "worst_tensors": [{"tensor": n, "max_abs_diff": d} for d, n in sorted(worst)[-3:]],
    })  # fmt: skip
    return report


# How TIES picks "the top density fraction" of each delta, as the two tools implement it:
#   exact_k_argsort     exactly int(density*n), ties at the cut broken by argsort order (mergekit)
#   exact_k_flat_order  exactly int(density*n), ties at the cut: the first in flat order (layerswap)
#   keep_ties           every entry >= the ceil(density*n)-th largest, ties included
SELECTIONS = ("exact_k_argsort", "exact_k_flat_order", "keep_ties")


def ties_reference(
    base: Any, experts: list[Any], density: float, *, float32: bool, selection: str
) -> tuple[Any, list[int]]:
    """TIES for one tensor (weights 1, normalize, lambda 1), written independently of both
    tools. float32=False does the arithmetic in the input dtype (bf16), as mergekit does by
    default. Returns the result and the number of non-zero deltas kept per expert."""
    import torch

    dtype = torch.float32 if float32 else base.dtype
    b = base.to(dtype)
    deltas, kept = [], []
    for x in experts:
        d = x.to(dtype) - b
        magnitude = d.abs().float().reshape(-1)
        n = magnitude.numel()
        if selection == "keep_ties":
            k = max(1, math.ceil(density * n))
            threshold = magnitude.kthvalue(n - k + 1).values
            keep = magnitude >= threshold
        else:
            stable = selection == "exact_k_flat_order"
            k = max(1, int(density * n))
            order = torch.argsort(magnitude, descending=True, stable=stable)
            keep = torch.zeros(n, dtype=torch.bool)
            keep[order[:k]] = True
        d = d.masked_fill(~keep.reshape(d.shape), 0)
        kept.append(int((d != 0).sum()))
        deltas.append(d)
    stacked = torch.stack(deltas)
    elected = (stacked.sum(0) >= 0).to(dtype) * 2 - 1
    agree = stacked.sign() == elected
    mixed = (stacked * agree).sum(0)
    divisor = agree.to(dtype).sum(0)
    divisor[divisor == 0] = 1
    return (b + mixed / divisor).to(base.dtype), kept


def ties_reference_check(
    ls_out: Path, mk_out: Path | None, models: dict[str, Path], layers: int
) -> dict[str, Any]:
    """Explain TIES differences on a sample of tensors: which reading of the selection, in
    which arithmetic, reproduces each tool's output exactly."""
    inputs = {k: Tensors(models[k]) for k in ("base", "task", "lang")}
    outputs = {"layerswap": Tensors(ls_out)}
    if mk_out is not None:
        outputs["mergekit"] = Tensors(mk_out)
    kinds = ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj", "input_layernorm")
    names = [f"model.layers.{i}.{k}.weight" for i in (0, layers // 2) for k in kinds]
    names.append("model.norm.weight")
    readings = [(f32, sel) for f32 in (True, False) for sel in SELECTIONS]
    mismatches: dict[str, dict[str, int]] = {tool: {} for tool in outputs}
    kept_fraction: dict[str, float] = {}
    for name in names:
        base = inputs["base"].get(name)
        experts = [inputs["task"].get(name), inputs["lang"].get(name)]
        got = {tool: t.get(name) for tool, t in outputs.items()}
        for f32, sel in readings:
            ref, kept = ties_reference(base, experts, 0.5, float32=f32, selection=sel)
            label = f"{'float32' if f32 else 'bf16'} {sel}"
            fraction = max(kept) / base.numel()
            kept_fraction[label] = max(kept_fraction.get(label, 0.0), fraction)
            for tool, value in got.items():
                wrong = int((value != ref).sum())
                mismatches[tool][label] = mismatches[tool].get(label, 0) + wrong
    explained = {
        tool: [label for label, wrong in counts.items() if wrong == 0]
        for tool, counts in mismatches.items()
    }
    return {
        "tensors": names,
        "elements_mismatching_per_reading": mismatches,
        "readings_reproducing_each_tool": explained,
        "largest_nonzero_kept_fraction_per_reading": {
            k: round(v, 4) for k, v in kept_fraction.items()
        },
    }


def reference_check(
    method: str, out: Path, models: dict[str, Path], layers: int, sample: int = 0
) -> dict[str, Any]:
    """Check an output against values computed directly from the inputs (layer swap: exact
    copies of the owning expert and float32-averaged non-layer tensors; soup: the float32
    average rounded once). sample=0 checks every tensor."""
    import torch

    from engine.architectures import Refusal, find_layer_stack

    got = Tensors(out)
    stack = find_layer_stack(json.loads((out / "config.json").read_text()), got.names())
    if isinstance(stack, Refusal):
        raise ValueError(stack.reason)
    inputs = {k: Tensors(models[k]) for k in ("task", "lang")}
    owners = layer_owners(layers, *swap_sizes(layers))
    names = got.names()
    if sample:
        names = names[:: max(1, len(names) // sample)]
    bad: list[str] = []
    for name in names:
        layer = stack.layer_of(name)
        if method == "layer_swap" and layer is not None:
            expected = inputs[owners[layer]].get(name)
        else:
            t, g = inputs["task"].get(name).float(), inputs["lang"].get(name).float()
            expected = (t * 0.5 + g * 0.5).to(torch.bfloat16)
        if not torch.equal(got.get(name), expected):
            bad.append(name)
    return {"tensors_checked": len(names), "mismatching": bad[:10], "ok": not bad}


# -- the run ---------------------------------------------------------------------------------
def build_cases(work: Path, models: dict[str, Path], layers: int, methods: list[str]) -> list[Case]:
    ls_recipes = layerswap_recipes(models, layers)
    mk_configs = mergekit_configs(models, layers)
    offline = (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"))
    cases = []
    for method in methods:
        reads = tuple(models[m] for m in READS[method])
        recipe = write_yaml(work / "recipes" / f"layerswap-{method}.yaml", ls_recipes[method])
        config = write_yaml(work / "recipes" / f"mergekit-{method}.yaml", mk_configs[method])
        out = work / "out" / f"{method}-layerswap"
        merge = (str(LAYERSWAP), "merge", str(recipe), "--out")
        cases.append(Case(method, "layerswap", "", (*merge, str(out)), out, inputs=reads))
        if method == "layer_swap":  # each variant writes its own directory
            out2 = out.with_name(out.name + "-no-fsync")
            no_fsync = (*merge, str(out2), "--no-fsync")
            cases.append(Case(method, "layerswap", "--no-fsync", no_fsync, out2, inputs=reads))
            out3 = out.with_name(out.name + "-cold-cache")
            cold = (*merge, str(out3))
            cases.append(
                Case(method, "layerswap", "cold sha256 cache", cold, out3, fresh_cache=True,
                     inputs=reads)
            )  # fmt: skip
        mk_out = work / "out" / f"{method}-mergekit"
        mk = (str(MERGEKIT), str(config), str(mk_out), "--no-cuda")
        cases.append(Case(method, "mergekit", "", mk, mk_out, env=offline, inputs=reads))
    copy_out = work / "out" / "copy-cp"
    cp = ("cp", "-r", str(models["base"]), str(copy_out))
    cases.append(Case("copy", "cp", "", cp, copy_out, inputs=(models["base"],)))
    # The same copy made durable like layerswap's default output: fsync of every copied file.
    synced = work / "out" / "copy-cp-fsync"
    script = 'cp -r "$0" "$1" && sync "$1"/*'
    argv = ("sh", "-c", script, str(models["base"]), str(synced))
    cases.append(Case("copy", "cp", "+ sync of its files", argv, synced, inputs=(models["base"],)))
    return cases


def environment() -> dict[str, Any]:
    def version(python: Path, module: str) -> str:
        code = f"import importlib.metadata as m; print(m.version({module!r}))"
        try:
            done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
            return done.stdout.strip() or "?"
        except OSError:
            return "?"

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "worker", "service"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    mem = next(
        (line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
         if line.startswith("MemTotal")), "0",
    )  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "memory_gb": round(int(mem) * 1024 / 1e9, 1),
        "kernel": platform.release(),
        "git_commit": commit + (" (+ uncommitted changes in worker/ or service/)" if dirty else ""),
        "layerswap_torch": version(ROOT / ".venv" / "bin" / "python", "torch"),
        "mergekit": version(ROOT / ".venv-bench" / "bin" / "python", "mergekit"),
        "mergekit_torch": version(ROOT / ".venv-bench" / "bin" / "python", "torch"),
        "mergekit_transformers": version(ROOT / ".venv-bench" / "bin" / "python", "transformers"),
    }


def size_of(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def summarize(results: list[CaseResult]) -> list[dict[str, Any]]:
    def find(method: str, tool: str) -> CaseResult | None:
        return next(
            (r for r in results if (r.method, r.tool, r.variant) == (method, tool, "")), None
        )

    cp = find("copy", "cp")
    synced = next((r for r in results if r.method == "copy" and "sync" in r.variant), None)

    def vs_synced(r: CaseResult) -> float | None:
        """Median of this case's wall / `cp` + `sync`'s in the same round: runs side by side
        hold the machine's speed at the time, which drifts over a long run."""
        if synced is None or len(synced.runs) != len(r.runs) or not r.runs:
            return None
        ratios = [a.wall_s / b.wall_s for a, b in zip(r.runs, synced.runs, strict=True)]
        return round(statistics.median(ratios), 2)

    rows = []
    for r in results:
        mk = find(r.method, "mergekit")
        rows.append({
            "method": r.method, "tool": r.tool + (f" {r.variant}" if r.variant else ""),
            "command": r.command,
            "median_wall_s": round(r.median_wall_s, 2), "peak_rss_mb": round(r.peak_rss_mb),
            "median_cpu_s": round(statistics.median(m.cpu_s for m in r.runs), 2),
            "walls_s": [round(m.wall_s, 2) for m in r.runs],
            "rss_mb": [round(m.max_rss_kb * 1024 / 1e6) for m in r.runs],
            "cpu_s": [round(m.cpu_s, 1) for m in r.runs],
            "steal_pct": [round(100 * m.steal) for m in r.runs],
            "speedup_vs_mergekit": (
                round(mk.median_wall_s / r.median_wall_s, 2) if mk and r.tool != "mergekit"
                else None
            ),
            "wall_vs_cp": (
                round(r.median_wall_s / cp.median_wall_s, 2) if cp and cp.median_wall_s > 0
                else None
            ),
            "wall_vs_cp_sync_by_round": vs_synced(r),
        })  # fmt: skip
    return rows


def markdown(report: dict[str, Any]) -> str:
    env, setup = report["environment"], report["setup"]
    lines = [
        f"# Benchmark: preset `{setup['preset']}`",
        "",
        f"{setup['params_b']:.3f}B parameters, {setup['model_gb']:.2f} GB per model (bf16, "
        f"{setup['shards']} shard(s)), {setup['layers']} layers; layer swap bottom="
        f"{setup['bottom']} top={setup['top']}. Median of {setup['reps']} timed runs after "
        f"{setup['warmup']} warm-up run(s) per case; peak RSS is the largest "
        '`/usr/bin/time -v` "Maximum resident set size" over the timed runs.',
        "",
        "| method | tool | median wall s | median CPU s | CPU ns / parameter | peak RSS MB "
        "| speed-up vs mergekit | wall / cp wall | wall / cp + sync, by round |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        speedup = "—" if row["speedup_vs_mergekit"] is None else f"{row['speedup_vs_mergekit']}×"
        vs_cp = "—" if row["wall_vs_cp"] is None else f"{row['wall_vs_cp']}×"
        by_round = row.get("wall_vs_cp_sync_by_round")
        vs_synced = "—" if by_round is None else f"{by_round}×"
        cpu = row.get("median_cpu_s", 0.0)
        lines.append(
            f"| {row['method']} | {row['tool']} | {row['median_wall_s']:.2f} | {cpu:.2f} | "
            f"{cpu / setup['params_b']:.2f} | {row['peak_rss_mb']} | {speedup} | {vs_cp} | "
            f"{vs_synced} |"
        )
    lines += [
        "",
        "speed-up vs mergekit = mergekit's median wall / this row's (same method); "
        "wall / cp wall = this row's median wall / the median wall of `cp -r` of one input; "
        "wall / cp + sync, by round = the median over the rounds of this row's wall / the wall "
        "of `cp -r` + `sync` in the same round (every case runs once per round); "
        "CPU = user + system time of the command and its children (on a shared machine less "
        "noisy than wall time), per parameter of one model.",
        "",
        f"Command: `{setup['command']}`",
        "",
        f"Machine: {env['cpus']} CPUs, {env['memory_gb']} GB RAM, kernel {env['kernel']}; "
        f"load average before/after: {setup['loadavg_before']} / {setup['loadavg_after']}. "
        f"layerswap at {env['git_commit']} (torch {env['layerswap_torch']}); mergekit "
        f"{env['mergekit']} (torch {env['mergekit_torch']}, transformers "
        f"{env['mergekit_transformers']}). {env['date']}.",
        "",
        "Per-run figures (wall s / RSS MB / CPU s, user + system / % of the machine's CPU time "
        "stolen by the hypervisor during the run):",
        "",
    ]
    for row in report["rows"]:
        figures = zip(row["walls_s"], row["rss_mb"], row["cpu_s"], row["steal_pct"], strict=True)
        runs = ", ".join(f"{w} / {m} / {c} / {st} %" for w, m, c, st in figures)
        lines.append(f"- {row['method']} {row['tool']}: {runs}")
    if report.get("verification"):
        lines += ["", "## Verification (last outputs of the timed runs)", ""]
        for method, entry in report["verification"].items():
            for key, label in (
                ("layerswap_vs_mergekit", "layerswap vs mergekit"),
                ("layerswap_vs_mergekit_float32", "layerswap vs mergekit computing in float32"),
            ):
                if key in entry:
                    lines.append(f"- {method}, {label}: {describe_comparison(entry[key])}")
            if "ties_semantics" in entry:
                sem = entry["ties_semantics"]
                found = "; ".join(
                    f"{tool}: {', '.join(labels) or 'NONE'}"
                    for tool, labels in sem["readings_reproducing_each_tool"].items()
                )
                lines.append(
                    f"- {method}, {len(sem['tensors'])} sampled tensors recomputed from the "
                    f"inputs; the readings that reproduce each tool exactly: {found}"
                )
            if "layerswap_vs_reference" in entry:
                ref = entry["layerswap_vs_reference"]
                verdict = "all equal" if ref["ok"] else f"MISMATCH {ref['mismatching']}"
                lines.append(
                    f"- {method}, layerswap vs a reference computed from the inputs: "
                    f"{ref['tensors_checked']} tensors, {verdict}"
                )
    return "\n".join(lines) + "\n"


def describe_comparison(c: dict[str, Any]) -> str:
    text = f"{c['tensors_identical']}/{c['tensors_compared']} tensors bit-identical"
    if c["only_in_layerswap"] or c["only_in_mergekit"]:
        text += (
            f"; MISSING tensors (only in layerswap: {c['only_in_layerswap'][:3]}, "
            f"only in mergekit: {c['only_in_mergekit'][:3]})"
        )
    if c["tensors_differing"]:
        text += (
            f"; {c['elements_differing']} of {c['elements']} elements differ "
            f"({100 * c['fraction_elements_differing']:.2f}%), max abs diff "
            f"{c['max_abs_diff']:.3g}, at most {c['max_ulp_diff_same_sign']} ulp(s) apart"
        )
    return text


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def verify(
    methods: list[str], work: Path, models: dict[str, Path], layers: int, ties_f32: bool
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for method in methods:
        ls_out, mk_out = work / "out" / f"{method}-layerswap", work / "out" / f"{method}-mergekit"
        entry: dict[str, Any] = {}
        if not ls_out.is_dir():
            continue
        if mk_out.is_dir():
            entry["layerswap_vs_mergekit"] = compare_outputs(ls_out, mk_out)
        if method in ("layer_swap", "soup"):
            entry["layerswap_vs_reference"] = reference_check(method, ls_out, models, layers)
        if method == "ties":
            mk = mk_out if mk_out.is_dir() else None
            entry["ties_semantics"] = ties_reference_check(ls_out, mk, models, layers)
        result[method] = entry
        print(f"verify {method}: {json.dumps(entry)[:600]}", flush=True)
    for method, entry in result.items():
        if "layerswap_vs_mergekit" in entry and (
            method in ANGLE_METHODS or (method == "ties" and ties_f32)
        ):
            compared = compare_with_float32_mergekit(method, work, models, layers)
            entry["layerswap_vs_mergekit_float32"] = compared
            print(f"verify {method} vs mergekit float32: {json.dumps(compared)[:400]}", flush=True)
    return result


def compare_with_float32_mergekit(
    method: str, work: Path, models: dict[str, Path], layers: int
) -> dict[str, Any]:
    config = float32_config(mergekit_configs(models, layers)[method])
    path = write_yaml(work / "recipes" / f"mergekit-{method}-float32.yaml", config)
    out = work / "out" / f"{method}-mergekit-float32"
    remove(out)
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(
        [str(MERGEKIT), str(path), str(out), "--no-cuda", "--quiet"],
        check=True, env={**os.environ, **offline}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    compared = compare_outputs(work / "out" / f"{method}-layerswap", out)
    remove(out)
    return compared


def fill_sha256_cache(cache: Path, models: tuple[Path, ...]) -> None:
    """Hash every input, untimed, into the sha256 cache the warm layerswap cases use: their
    rows are warm-cache figures (the cold-cache row is the other), and without warm-up runs
    the first of them would otherwise hash 10 GB of inputs."""
    sys.path.insert(0, str(ROOT))
    from engine.io.digests import file_sha256

    for model in models:
        for path in sorted(p for p in model.iterdir() if p.is_file()):
            file_sha256(path, cache / "sha256")  # as layerswap/cli/common.py lays out its cache


def rounds(cases: list[Case], warmup: int, reps: int) -> Iterator[tuple[int, Case]]:
    """(round, case) in execution order: warm-up rounds are negative."""
    for r in range(-warmup, reps):
        for case in cases:
            yield r, case


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--preset", default="small", help="a directory under bench/data")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--methods", default=",".join(METHODS),
        help=f"comma-separated; also: {', '.join(SPARSE_METHODS + ANGLE_METHODS)}",
    )  # fmt: skip
    parser.add_argument(
        "--tools", default=",".join(TOOLS),
        help="comma-separated; a subset writes results/<preset>-partial.{md,json}",
    )  # fmt: skip
    parser.add_argument("--no-verify", dest="verify", action="store_false")
    parser.add_argument(
        "--ties-float32", action="store_true",
        help="also compare layerswap's TIES with mergekit's computed in float32 (verification)",
    )  # fmt: skip
    parser.add_argument("--keep-outputs", action="store_true")
    args = parser.parse_args(argv)
    cli_args = argv if argv is not None else sys.argv[1:]
    methods = [m for m in args.methods.split(",") if m]
    tools = [t for t in args.tools.split(",") if t]
    if unknown_tools := set(tools) - set(TOOLS):
        parser.error(f"unknown tools: {sorted(unknown_tools)}")
    partial = set(methods) != set(METHODS) or set(tools) != set(TOOLS)
    name = args.preset + ("-partial" if partial else "")
    if unknown := set(methods) - set(METHODS) - set(SPARSE_METHODS) - set(ANGLE_METHODS):
        parser.error(f"unknown methods: {sorted(unknown)}")
    preset_dir = DATA_DIR / args.preset
    if not (preset_dir / "complete.json").is_file():
        sys.exit(f"{preset_dir}: no checkpoints; run make_checkpoints.py --preset {args.preset}")
    for tool in (LAYERSWAP, MERGEKIT, TIME):
        if not tool.exists():
            sys.exit(f"{tool} is missing (bash scripts/setup.sh; bash bench/setup.sh)")
    description = json.loads((preset_dir / "complete.json").read_text())
    layers = int(description["layers"])
    bottom, top = swap_sizes(layers)
    models = {m: preset_dir / m for m in ("base", "task", "lang")}
    work = preset_dir / "work"
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cache_root = work / "sha256-cache"
    shutil.rmtree(cache_root, ignore_errors=True)
    if "layerswap" in tools:
        fill_sha256_cache(cache_root / "warm", tuple(models.values()))

    cases = [c for c in build_cases(work, models, layers, methods) if c.tool in tools]
    results = {c.key: CaseResult(c.method, c.tool, c.variant, " ".join(c.argv)) for c in cases}
    loadavg_before = loadavg()
    for r, case in rounds(cases, args.warmup, args.reps):
        m = run_case(case, logs, cache_root)
        label = "warm-up" if r < 0 else f"rep {r + 1}/{args.reps}"
        print(f"{label:>10}  {case.key:<40} {m.wall_s:7.2f} s  {m.max_rss_kb * 1024 / 1e6:8.0f} MB",
              flush=True)  # fmt: skip
        if r >= 0:
            results[case.key].runs.append(m)
        keep = args.verify and r == args.reps - 1 and case.variant == "" and case.tool != "cp"
        if not keep and not args.keep_outputs:
            remove(case.out)
    loadavg_after = loadavg()

    verification = {}
    if args.verify:
        verification = verify(methods, work, models, layers, args.ties_float32)
    if not args.keep_outputs:
        for case in cases:
            remove(case.out)

    model_bytes = size_of(models["base"])
    params = model_bytes // 2
    report = {
        "setup": {
            "preset": args.preset, "layers": layers, "bottom": bottom, "top": top,
            "params_b": params / 1e9, "model_gb": model_bytes / 1e9,
            "shards": len(list(models["base"].glob("*.safetensors"))),
            "reps": args.reps, "warmup": args.warmup,
            "command": ".venv/bin/python bench/run.py " + " ".join(cli_args),
            "loadavg_before": loadavg_before, "loadavg_after": loadavg_after,
            "mergekit_options": "--no-cuda (its default); otherwise defaults "
                                "(out-shard-size 5B params, no lazy-unpickle, no async-write)",
            "layerswap_options": "defaults (fsync on, shard_size 2GB, device cpu)",
            "recipes": {p.name: p.read_text() for p in sorted((work / "recipes").glob("*.yaml"))},
        },
        "environment": environment(),
        "rows": summarize(list(results.values())),
        "verification": verification,
    }  # fmt: skip
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (RESULTS_DIR / f"{name}.md").write_text(text)
    print(text)
    if verification and not all(
        v.get("layerswap_vs_reference", {"ok": True})["ok"] for v in verification.values()
    ):
        sys.exit("verification failed: see the report")


if __name__ == "__main__":
    main()
