"""nuslerp and model_stock against mergekit 0.1.5 on the same checkpoints, every tensor compared.

mergekit computes both in its `dtype` (bf16 arithmetic when that is bfloat16), Layerswap in
float32 rounded once; so mergekit runs with dtype float32 and out_dtype the checkpoints' own.
Expected: equal bits where every vector is read whole (all tensors of these test models at the
default chunk); at most 1 bf16 ulp where vectors longer than a chunk are measured by moments
summed in another order than mergekit's one reduction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.engine.mergekit_parity import family_config, run_mergekit, ulp_distance, worst_ulps
from tests.engine.vocabularies import embedding_names, make_chat_family, vocabulary
from tests.reference import load

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
    models = [("task", {"weight": weights[0]}), ("language", {"weight": weights[1]})]
    config = family_config("nuslerp", fam, models, dtype, parameters=switches)
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
    assert worst_ulps(ours, theirs) == 0


def _model_stock_config(fam: Family, models: list[str], filter_wise: Any, dtype: str) -> Any:
    return family_config(
        "model_stock", fam, [(m, {}) for m in models], dtype, base_model=str(fam.base),
        parameters={"filter_wise": filter_wise},
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
    assert worst_ulps(ours, theirs) == 0


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
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) <= 1


@pytest.mark.parametrize("method", ["nuslerp", "model_stock"])
def test_with_tokenizer_source_equals_mergekit(
    method: str, run_merge: Any, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Fine-tunes that added different tokens, merged over the union of their vocabularies:
    each output token's embedding and head rows, compared by token, and every other tensor
    equal mergekit's bit for bit (float32 checkpoints: mergekit fills in the rows of tokens an
    input lacks in its dtype, float32 here, as Layerswap does in the checkpoints')."""
    family = make_chat_family(tmp_path_factory.mktemp("vocab"), dtype=torch.float32, seed=7)
    models = [family.chat, family.tool]
    ours = run_merge(
        {"method": method, "base": family.base, "models": models, "tokenizer_source": "union"}
    ).out_dir
    weights: dict[str, Any] = {"weight": 1.0} if method == "nuslerp" else {}
    theirs = run_mergekit(
        {
            "merge_method": method,
            "base_model": str(family.base),
            "models": [{"model": str(m), "parameters": weights} for m in models],
            "dtype": "float32",
            "out_dtype": "float32",
            "tokenizer_source": "union",
        },
        tmp_path / "mergekit",
    )
    mine, reference = vocabulary(ours), vocabulary(theirs)
    assert set(mine) == set(reference) and len(mine) > 256
    ours_t, theirs_t = load(ours), load(theirs)
    assert set(ours_t) == set(theirs_t)
    order = sorted(mine)
    for name in ours_t:
        if name in embedding_names(ours_t):
            a = ours_t[name][[mine[t] for t in order]]
            b = theirs_t[name][[reference[t] for t in order]]
        else:
            a, b = ours_t[name], theirs_t[name]
        assert ulp_distance(a, b) == 0, name
