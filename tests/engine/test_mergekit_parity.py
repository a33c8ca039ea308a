"""linear, slerp, passthrough, nuslerp and model_stock against mergekit 0.1.5 on the same
checkpoints, every tensor compared.

mergekit runs in .venv-bench (bench/setup.sh) with out_dtype = the checkpoints' own and dtype
the same for linear and slerp, whose kernels widen to float32 themselves; nuslerp and
model_stock compute in `dtype` (bf16 arithmetic for bf16), so theirs is float32: both sides
then widen to float32, compute and round once. Expected: equal bits; at most 1 ulp where a
reduction (slerp's norms and dot; the angles of vectors longer than a chunk) sums in another
order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.engine.mergekit_parity import run_mergekit, ulp_distance
from tests.reference import load

GRADIENT_T = [
    {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
    {"value": 0.5},
]


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory: pytest.TempPathFactory, llama32: Family) -> Path:
    """A float32 Llama initialised apart from llama32: about 90° from it, far from lerp."""
    from worker.examples import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("unrelated") / "model", arch="llama", layers=6,
        dtype=torch.float32, seed=77,
    )  # fmt: skip


def _compare(ours: Path, theirs: Path) -> int:
    mine, reference = load(ours), load(theirs)
    assert set(mine) == set(reference)
    worst = max(ulp_distance(mine[k], reference[k]) for k in mine)
    print(f"max ulp distance to mergekit: {worst}")
    return worst


def _mergekit_config(
    method: str, fam: Family, models: list[tuple[str, dict[str, Any]]], dtype: str, **extra: Any
) -> dict[str, Any]:
    return {
        "merge_method": method,
        "models": [{"model": str(getattr(fam, m)), "parameters": p} for m, p in models],
        "dtype": dtype,
        "out_dtype": dtype,
        **extra,
    }


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    ("weights", "normalize"),
    [([0.3, 0.6, 0.45], True), ([0.7, -0.2, 0.5], False), ([[1, 0, 2], 0.5, [0.1, 1]], True)],
    ids=["normalize", "sum", "gradients"],
)
def test_linear_equals_mergekit(
    family_name: str,
    weights: list[Any],
    normalize: bool,
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    names = ["task", "language", "task2"]
    recipe = {
        "method": "linear",
        "models": [getattr(fam, m) for m in names],
        "params": {"weights": weights, "normalize": normalize},
    }
    ours = run_merge(recipe).out_dir
    dtype = "bfloat16" if family_name == "llama" else "float32"
    config = _mergekit_config(
        "linear",
        fam,
        [(m, {"weight": w}) for m, w in zip(names, weights, strict=True)],
        dtype,
        parameters={"normalize": normalize},
    )
    assert _compare(ours, run_mergekit(config, tmp_path / "mergekit")) == 0


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    ("t", "pair"),
    [(0.3, ("task", "language")), ([0, 0.5, 1], ("base", "language")),
     (GRADIENT_T, ("task", "language"))],
    ids=["scalar", "gradient", "filters"],
)  # fmt: skip
def test_slerp_equals_mergekit(
    family_name: str,
    t: Any,
    pair: tuple[str, str],
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    recipe = {"method": "slerp", "models": [getattr(fam, m) for m in pair], "params": {"t": t}}
    ours = run_merge(recipe).out_dir
    dtype = "bfloat16" if family_name == "llama" else "float32"
    config = _mergekit_config(
        "slerp",
        fam,
        [(pair[0], {}), (pair[1], {})],
        dtype,
        base_model=str(getattr(fam, pair[0])),
        parameters={"t": t},
    )
    assert _compare(ours, run_mergekit(config, tmp_path / "mergekit")) <= 1


def test_slerp_far_apart_equals_mergekit(
    llama32: Family, unrelated: Path, run_merge: Any, tmp_path: Path
) -> None:
    recipe = {"method": "slerp", "models": [llama32.base, unrelated], "params": {"t": GRADIENT_T}}
    ours = run_merge(recipe).out_dir
    config = {
        "merge_method": "slerp",
        "models": [{"model": str(llama32.base)}, {"model": str(unrelated)}],
        "base_model": str(llama32.base),
        "parameters": {"t": GRADIENT_T},
        "dtype": "float32",
        "out_dtype": "float32",
    }
    assert _compare(ours, run_mergekit(config, tmp_path / "mergekit")) <= 1


def _slices_config(slices: list[tuple[Path, int, int]], dtype: str) -> dict[str, Any]:
    return {
        "merge_method": "passthrough",
        "slices": [{"sources": [{"model": str(m), "layer_range": [a, b]}]} for m, a, b in slices],
        "dtype": dtype,
        "out_dtype": dtype,
    }


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_passthrough_equals_mergekit(
    family_name: str, request: pytest.FixtureRequest, run_merge: Any, tmp_path: Path
) -> None:
    """Deeper and from two models: every tensor's bits, and the output's layer count."""
    if family_name == "llama":
        fam: Family = request.getfixturevalue("llama")
        slices, dtype, key = (
            [(fam.task, 0, 4), (fam.language, 2, 6)],
            "bfloat16",
            "num_hidden_layers",
        )
    else:
        a, b = request.getfixturevalue("gpt2_pair")
        slices, dtype, key = [(a, 0, 3), (b, 1, 4), (a, 3, 4)], "float32", "n_layer"
    recipe = {
        "method": "passthrough",
        "models": list(dict.fromkeys(str(m) for m, _, _ in slices)),
        "params": {"slices": [{"sources": [{"model": str(m), "layer_range": [s, e]}]}
                              for m, s, e in slices]},
    }  # fmt: skip
    ours = run_merge(recipe).out_dir
    theirs = run_mergekit(_slices_config(slices, dtype), tmp_path / "mergekit")
    assert _compare(ours, theirs) == 0
    layers = sum(e - s for _, s, e in slices)
    for out in (ours, theirs):
        assert json.loads((out / "config.json").read_text())[key] == layers


NUSLERP_CASES = [
    (False, {"weights": [0.3, [0.2, 1.0]]}),
    (True, {"weights": [1.0, 2.0]}),
    (True, {"nuslerp_flatten": [{"filter": "self_attn", "value": False}, {"value": True}]}),
    (False, {"nuslerp_flatten": [True, False], "nuslerp_row_wise": True}),
]
NUSLERP_IDS = ["gradient", "base", "rows-by-filter", "columns-by-layer"]


def _nuslerp_config(fam: Family, with_base: bool, params: dict[str, Any], dtype: str) -> Any:
    weights = params.get("weights", [1.0, 1.0])
    switches = {k: v for k, v in params.items() if k != "weights"}
    config = _mergekit_config(
        "nuslerp", fam, [("task", {"weight": weights[0]}), ("language", {"weight": weights[1]})],
        "float32", parameters=switches, out_dtype=dtype,
    )  # fmt: skip
    if with_base:
        config["base_model"] = str(fam.base)
    return config


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(("with_base", "params"), NUSLERP_CASES, ids=NUSLERP_IDS)
def test_nuslerp_equals_mergekit(
    family_name: str,
    with_base: bool,
    params: dict[str, Any],
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    recipe: dict[str, Any] = {"method": "nuslerp", "models": [fam.task, fam.language],
                              "params": params}  # fmt: skip
    if with_base:
        recipe["base"] = fam.base
    ours = run_merge(recipe).out_dir
    dtype = "bfloat16" if family_name == "llama" else "float32"
    theirs = run_mergekit(_nuslerp_config(fam, with_base, params, dtype), tmp_path / "mergekit")
    assert _compare(ours, theirs) == 0


def _model_stock_config(fam: Family, models: list[str], filter_wise: Any, dtype: str) -> Any:
    return _mergekit_config(
        "model_stock", fam, [(m, {}) for m in models], "float32", out_dtype=dtype,
        base_model=str(fam.base), parameters={"filter_wise": filter_wise},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("family_name", "count", "filter_wise"),
    [("llama", 2, False), ("llama", 3, True), ("llama32", 3, False), ("llama32", 2, True),
     ("llama", 2, [{"filter": "mlp", "value": True}, {"value": False}])],
    ids=["llama-2", "llama-3-rows", "llama32-3", "llama32-2-rows", "llama-2-rows-by-filter"],
)  # fmt: skip
def test_model_stock_equals_mergekit(
    family_name: str,
    count: int,
    filter_wise: Any,
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    models = ["task", "language", "task2"][:count]
    recipe = {
        "method": "model_stock",
        "base": fam.base,
        "models": [getattr(fam, m) for m in models],
        "params": {"filter_wise": filter_wise},
    }
    ours = run_merge(recipe).out_dir
    dtype = "bfloat16" if family_name == "llama" else "float32"
    theirs = run_mergekit(_model_stock_config(fam, models, filter_wise, dtype), tmp_path / "mk")
    assert _compare(ours, theirs) == 0


@pytest.mark.parametrize("method", ["nuslerp", "model_stock"])
def test_vectors_longer_than_a_chunk_within_an_ulp_of_mergekit(
    method: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """With chunks of 1,000 elements every weight of the test models is measured by its
    moments over chunks (summed in float64, in another order than mergekit's one reduction):
    the bf16 outputs stay within 1 ulp of mergekit's (a float32 output differs in the last
    bits, which are many ulps of its elements far smaller than their tensor)."""
    if method == "nuslerp":
        recipe: dict[str, Any] = {"method": "nuslerp", "models": [llama.task, llama.language]}
        config = _nuslerp_config(llama, False, {}, "bfloat16")
    else:
        recipe = {"method": "model_stock", "base": llama.base,
                  "models": [llama.task, llama.language, llama.task2]}  # fmt: skip
        config = _model_stock_config(llama, ["task", "language", "task2"], False, "bfloat16")
    ours = run_merge(recipe, chunk_elements=1000).out_dir
    assert _compare(ours, run_mergekit(config, tmp_path / "mergekit")) <= 1
